// Helpers shared by the example programs (generate, streams): argument errors, number parsing, one-line
// messages and the process's resident memory.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace example {

// A bad command line: main() prints it with "(see --help)" and exits with code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The whole of `value` as a T, or a UsageError naming `flag`.
template <typename T>
T parse_number(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    T out;
    if constexpr (std::is_floating_point_v<T>)
      out = static_cast<T>(std::stod(value, &used));
    else if constexpr (std::is_unsigned_v<T>)
      out = static_cast<T>(std::stoull(value, &used));
    else
      out = static_cast<T>(std::stoll(value, &used));
    if (used == value.size()) return out;
  } catch (const std::exception&) {
  }
  throw UsageError("bad value for " + flag + ": '" + value + "'");
}

// `s` with line breaks turned into spaces: every error is one line on stderr.
inline std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

// A file that will be written (replaced if it exists): not a directory, in an existing writable directory, as
// edgeattn.cli's check_output_file. A UsageError naming `flag` otherwise.
inline void check_output_file(const std::string& path, const std::string& flag) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    throw UsageError(flag + " " + path + " is a directory; give a file name");
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw UsageError(flag + " " + path + ": directory " + dir + " does not exist");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw UsageError(flag + " " + path + ": directory " + dir + " is not writable");
}

// Resident memory of this process in bytes (VmRSS), or -1 where /proc/self/status is not available.
inline int64_t resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) {  // "VmRSS:   1234 kB"
      try {
        return std::stoll(line.substr(6)) * 1024;
      } catch (const std::exception&) {
        return -1;
      }
    }
  return -1;
}

}  // namespace example
