// State files: 8-byte little-endian header length N, N bytes of JSON header (space-padded to a multiple of 8),
// then the raw little-endian float32 tensors back to back.
#include "state_file.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "edgeattn/session.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "edgeattn state files are little-endian; this runtime supports little-endian hosts only"
#endif

namespace edgeattn::detail {
namespace {

using json = nlohmann::json;
constexpr uint64_t kMaxHeader = 100u << 20;  // the safetensors limit

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void write_state_file(const std::string& path, const std::vector<StateTensorView>& tensors,
                      const std::string& fingerprint, int64_t position) {
  json header = json::object();
  uint64_t offset = 0;
  std::string data;  // every tensor's bytes, back to back: hashed, then written
  for (const auto& t : tensors) {
    const size_t n = static_cast<size_t>(numel(t.shape));
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(t.data[i]))
        throw StateFileError("cannot write state file " + path + ": state tensor " + t.name +
                             " holds NaN or inf; a state file holds finite values only");
    const uint64_t bytes = static_cast<uint64_t>(n) * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    data.append(reinterpret_cast<const char*>(t.data), bytes);
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "edgeattn-state"},
                            {"format_version", std::to_string(kStateFormatVersion)},
                            {"fingerprint", fingerprint},
                            {"position", std::to_string(position)},
                            {"data_sha256", sha256_hex(data.data(), data.size())}};
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');

  std::random_device rd;
  const std::string tmp = path + ".tmp" + std::to_string(rd() % 1000000);
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw StateFileError("cannot write state file " + path + ": " + std::strerror(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(head.size()) >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(head.data(), 1, head.size(), f) == head.size();
  ok = ok && std::fwrite(data.data(), 1, data.size(), f) == data.size();
  ok = ok && std::fflush(f) == 0;
#if defined(__unix__) || defined(__APPLE__)
  ok = ok && ::fsync(fileno(f)) == 0;
#endif
  const int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw StateFileError("cannot write state file " + path + ": " + std::strerror(ok ? errno : err));
  }
}

LoadedState read_state_file(const std::string& path) {
  if (is_special_file(path)) throw StateFileError("state file " + path + " is not a regular file (a FIFO or device?)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw StateFileError("cannot read state file " + path + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string raw = ss.str();
  auto bad = [&](const std::string& why) { return StateFileError(path + " is not an edgeattn state file: " + why); };

  if (raw.size() < 8) throw bad("shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(raw[i])) << (8 * i);
  if (n > kMaxHeader || n > raw.size() - 8)
    throw bad("header length " + std::to_string(n) + " does not fit the file's " + std::to_string(raw.size()) +
              " bytes");
  json header;
  try {
    header = json::parse(raw.substr(8, n));
  } catch (const json::exception&) {
    throw bad("header is not JSON");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  auto meta_it = header.find("__metadata__");
  if (meta_it == header.end() || !meta_it->is_object() || meta_it->value("format", json()) != "edgeattn-state")
    throw bad("no __metadata__ with \"format\": \"edgeattn-state\"");
  const json& meta = *meta_it;
  for (const auto& v : meta)
    if (!v.is_string()) throw bad("__metadata__ values must be strings");

  LoadedState out;
  const std::string version = meta.value("format_version", "");
  if (version.empty() || version.find_first_not_of("0123456789") != std::string::npos)
    throw bad("format_version \"" + version + "\" is not an integer");
  if (version.size() > 9 || std::stoll(version) > kStateFormatVersion)
    throw StateFileError(path + " has state format_version " + version + "; this edgeattn runtime reads up to " +
                         std::to_string(kStateFormatVersion));
  if (std::stoll(version) < kStateFormatVersion)
    throw StateFileError(path + " is a state file of format_version " + version +
                         ", written before state files carried a checksum; this edgeattn runtime reads version " +
                         std::to_string(kStateFormatVersion) + ": save the state again");
  const std::string checksum = meta.value("data_sha256", "");
  if (checksum.size() != 64 || checksum.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw bad("no data_sha256 (a sha256 hex digest) in __metadata__");
  out.fingerprint = meta.value("fingerprint", "");
  if (out.fingerprint.empty()) throw bad("no fingerprint in __metadata__");
  const std::string position = meta.value("position", "");
  if (position.empty() || position.size() > 18 || position.find_first_not_of("0123456789") != std::string::npos)
    throw bad("position \"" + position + "\" is not a non-negative integer");
  out.position = std::stoll(position);

  const char* data = raw.data() + 8 + n;
  const uint64_t data_size = raw.size() - 8 - n;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& info = it.value();
    if (!info.is_object()) throw bad("entry " + name + " is not an object");
    if (info.value("dtype", json()) != "F32") throw bad("tensor " + name + " is not F32");
    const json shape = info.value("shape", json());
    const json offsets = info.value("data_offsets", json());
    std::vector<int64_t> dims;
    bool shape_ok = shape.is_array();
    for (const json& d : shape) {
      shape_ok = shape_ok && d.is_number_unsigned();
      if (shape_ok) dims.push_back(d.get<int64_t>());
    }
    if (!shape_ok) throw bad("tensor " + name + " has an invalid shape");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw bad("tensor " + name + " has invalid data_offsets");
    const uint64_t begin = offsets[0], end = offsets[1];
    if (begin > end || end > data_size || end - begin != static_cast<uint64_t>(numel(dims)) * sizeof(float))
      throw bad("tensor " + name + ": data_offsets do not match its shape in " + std::to_string(data_size) +
                " data bytes");
    std::vector<float> values(static_cast<size_t>(numel(dims)));
    if (!values.empty()) std::memcpy(values.data(), data + begin, end - begin);
    spans.emplace_back(begin, end);
    out.names.push_back(name);
    out.shapes.push_back(std::move(dims));
    out.data.push_back(std::move(values));
  }
  // safetensors packs tensors back to back with no holes; anything else is a truncated or damaged file
  std::sort(spans.begin(), spans.end());
  uint64_t cursor = 0;
  for (const auto& [begin, end] : spans) {
    if (begin != cursor) throw bad("tensor data has holes or overlaps");
    cursor = end;
  }
  if (cursor != data_size) throw bad(std::to_string(data_size - cursor) + " bytes after the last tensor");
  if (sha256_hex(data, data_size) != checksum)
    throw StateFileError(path + " is corrupt: its tensor data does not match the data_sha256 in its header");
  for (size_t i = 0; i < out.data.size(); ++i)
    for (float x : out.data[i])
      if (!std::isfinite(x))
        throw StateFileError(path + ": state tensor " + out.names[i] + " holds NaN or inf; a state must be finite");
  return out;
}

}  // namespace edgeattn::detail
