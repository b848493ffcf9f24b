// State files (safetensors, docs/artifact-format.md): the same format as edgeattn/runtimes/state_file.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace edgeattn::detail {

// 2: __metadata__ carries "data_sha256", the sha256 of all the tensor bytes. Version 1 files (no checksum) are
// refused with a message saying so.
constexpr int kStateFormatVersion = 2;

// Lower-case hex sha256 of a buffer (sha256.cpp).
std::string sha256_hex(const void* data, size_t size);

// True when `path` exists and is not a regular file (a FIFO, socket or device; sha256.cpp): reading one can block
// forever or never end, so every reader of artifact and state files refuses it before opening it, as Python does.
bool is_special_file(const std::string& path);

struct StateTensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;
};

struct LoadedState {
  std::vector<std::string> names;  // in file order
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> data;
  std::string fingerprint;
  int64_t position = 0;
};

// Writes to a temporary file next to `path`, then renames it over `path`. Refuses NaN and inf.
void write_state_file(const std::string& path, const std::vector<StateTensorView>& tensors,
                      const std::string& fingerprint, int64_t position);

// Parses and checks the file's structure, its data_sha256 and that every value is finite (StateFileError
// otherwise); the caller checks fingerprint and names.
LoadedState read_state_file(const std::string& path);

}  // namespace edgeattn::detail
