// State files (safetensors, docs/artifact-format.md): the same format as edgeattn/runtimes/state_file.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace edgeattn::detail {

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

// Writes to a temporary file next to `path`, then renames it over `path`.
void write_state_file(const std::string& path, const std::vector<StateTensorView>& tensors,
                      const std::string& fingerprint, int64_t position);

// Parses and checks the file's structure (StateFileError otherwise); the caller checks fingerprint and names.
LoadedState read_state_file(const std::string& path);

}  // namespace edgeattn::detail
