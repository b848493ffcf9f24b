// The internals of edgeattn::Session, shared by session.cpp and streams.cpp (not installed).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// The API is initialised in ort_api() (session.cpp), so a runtime older than the headers is an exception, not a crash.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "edgeattn/session.hpp"

namespace edgeattn {
namespace detail {

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// Bytes per element of a state tensor: float32; a KV buffer float16 or int8 too.
inline size_t state_item_bytes(const std::string& dtype) { return dtype == "int8" ? 1 : dtype == "float16" ? 2 : 4; }

inline Ort::Value zeros(Ort::Allocator& allocator, const std::vector<int64_t>& shape, ONNXTensorElementDataType type,
                        size_t item_bytes) {
  Ort::Value v = Ort::Value::CreateTensor(allocator, shape.data(), shape.size(), type);
  std::memset(v.GetTensorMutableRawData(), 0, static_cast<size_t>(numel(shape)) * item_bytes);
  return v;
}

template <typename T>
Ort::Value zeros(Ort::Allocator& allocator, const std::vector<int64_t>& shape) {
  Ort::Value v = Ort::Value::CreateTensor<T>(allocator, shape.data(), shape.size());
  std::memset(v.GetTensorMutableData<T>(), 0, static_cast<size_t>(numel(shape)) * sizeof(T));
  return v;
}

// A read-only mapping of a whole file (the shared weights), unmapped when destroyed.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    // O_NONBLOCK: opening a FIFO returns at once (it would wait for a writer), and fstat refuses it below
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw IntegrityError("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw IntegrityError(path + " is not a regular file (a FIFO or device?)");
    }
    if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
      ::close(fd);
      throw IntegrityError("cannot read " + path + " (empty or unreadable)");
    }
    size_ = static_cast<size_t>(st.st_size);
    data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (data_ == MAP_FAILED) throw RuntimeError("cannot map " + path + ": " + std::strerror(err));
  }
  ~MappedFile() {
    if (data_ != MAP_FAILED) ::munmap(data_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  char* data() const { return static_cast<char*>(data_); }
  // Give the resident pages back to the kernel. The mapping stays valid: a page read again is read from the file
  // (a private, read-only mapping that nothing wrote to holds the file's bytes).
  void release() const { ::madvise(data_, size_, MADV_DONTNEED); }
  size_t size() const { return size_; }

 private:
  void* data_ = MAP_FAILED;
  size_t size_ = 0;
};

inline ONNXTensorElementDataType element_type(const std::string& dtype) {
  if (dtype == "float32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (dtype == "float16") return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  if (dtype == "float64") return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
  if (dtype == "int8") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  if (dtype == "uint8") return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  if (dtype == "int32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  if (dtype == "int64") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  throw ManifestError("weights tensor of unknown dtype " + dtype);
}

// A reduced KV buffer (float16 or int8, [B, H, L, D]) and float32 values, converted over slots [0, n) of every
// (batch, head) row; the other slots of `out` are left as they are. int8: x = q * scale, q = clip(rint(x / scale),
// -128, 127) with the per-(head, channel) scales; float16: IEEE conversion, round to nearest even.
void kv_to_float(const StateEntry& e, const std::vector<int64_t>& shape, const void* kv, int64_t n, float* out);
void kv_from_float(const StateEntry& e, const std::vector<int64_t>& shape, const float* x, int64_t n, void* kv);

// One graph with its own preallocated input_ids and logits, and two bindings: binding[p] reads state set p and
// writes state set 1 - p. `session` is `own`, or the other graph's session when both name the same file.
struct Graph {
  std::string file;
  int64_t tokens = 0;  // 0: the artifact has no such graph
  Ort::Session own{nullptr};
  Ort::Session* session = nullptr;
  bool shares_session = false;  // true: `session` belongs to the other graph
  Ort::Allocator allocator{nullptr};
  Ort::Value ids{nullptr};     // [1, tokens] int64
  Ort::Value logits{nullptr};  // [1, tokens, vocab] float ([1, 1, vocab] with "prefill_logits" "last")
  Ort::IoBinding binding[2] = {Ort::IoBinding{nullptr}, Ort::IoBinding{nullptr}};
};

// "a,b,,c" -> {"a", "b", "c"}
inline std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= s.size();) {
    const size_t comma = std::min(s.find(',', at), s.size());
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// Why edgeattn's MatMulNBits kernel is not this CPU's choice ("": it is), as Python's
// edgeattn.runtimes.attention.matmul_chosen: it is on the CPU kinds it was raced on and won (AVX2 and FMA without
// AVX-512, with AVX-VNNI, or with AVX-512 VNNI, BW and DQ), not on AMX CPUs or AVX-512 without VNNI (not raced
// there). Read from CPUID and XCR0 (what the OS saves), so a process run through edgeattn.bench.cpu_as sees the
// narrowed CPU, as Python's does.
inline std::string matmul_not_chosen() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0, b7 = 0, c7 = 0, d7 = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return "the CPU lacks AVX2 or FMA";
  const bool avx = c & bit_AVX, fma = c & bit_FMA;
  uint64_t xcr0 = 0;
  if (c & bit_OSXSAVE) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  if (__get_cpuid_max(0, nullptr) >= 7) __cpuid_count(7, 0, a, b7, c7, d7);
  if (!avx || !fma || !(b7 & bit_AVX2) || (xcr0 & 6) != 6) return "the CPU lacks AVX2 or FMA";
  if (d7 & ((1u << 24) | (1u << 25)))  // AMX-TILE, AMX-INT8
    return "an AMX CPU: not raced against ONNX Runtime's kernels there (name it in kernel_ops to run it anyway)";
  const bool avx512 = (b7 & bit_AVX512F) && (xcr0 & 0xe6) == 0xe6;
  if (avx512 && !((b7 & bit_AVX512BW) && (b7 & bit_AVX512DQ) && (c7 & (1u << 11))))  // AVX512-VNNI
    return "AVX-512 without VNNI: not raced against ONNX Runtime's kernels there (name it in kernel_ops to run it "
           "anyway)";
  return "";
#else
  return "not an x86 CPU (the kernel is AVX2 code)";
#endif
}

// Check a graph's inputs and outputs against the manifest before anything runs, so a mismatch names the tensor.
void check_io(const Graph& g, const Manifest& m, const std::vector<std::vector<int64_t>>& shapes);

}  // namespace detail

struct Session::Impl {
  Manifest manifest;
  Ort::Env env{nullptr};
  Ort::MemoryInfo cpu{nullptr};
  Ort::RunOptions run_options{nullptr};
  // The shared weights and their prepacked forms, declared before the graphs: the sessions go first.
  std::unique_ptr<detail::MappedFile> weights_file;
  std::vector<std::pair<std::string, Ort::Value>> weights;  // initializer name -> tensor over weights_file
  Ort::PrepackedWeightsContainer prepacked{nullptr};
  detail::Graph step, prefill;
  std::vector<std::vector<int64_t>> shapes;
  // Declared after the graphs: destroyed before the allocator they came from.
  std::vector<Ort::Value> state[2];
  int cur = 0;  // state[cur] holds the current state
  int64_t position = 0;
  std::string kernels, kernels_why;  // Session::kernels(), Session::kernels_why()

  // The ops of options.kernel_ops that this manifest has in the forms edgeattn's kernels take (as Python's
  // kernels_for_session: GroupQueryAttention over float32 KV buffers only, MatMulNBits in int4 artifacts); an
  // empty kernel_ops: both where they apply, MatMulNBits only where it is the CPU's choice, as Python's sessions
  // choose (a form the library does not take refuses at load: the graph loads without it).
  std::string kernel_ops(const SessionOptions& options) {
    const bool by_cpu = options.kernel_ops.empty();
    bool kv = false, kv_float = true;
    for (const auto& e : manifest.state)
      if (e.shared) kv = true, kv_float = kv_float && e.dtype == "float32";
    std::string ops, skipped, cpu_why;
    for (const std::string& op :
         detail::split_commas(by_cpu ? std::string("GroupQueryAttention,MatMulNBits") : options.kernel_ops)) {
      bool take = false;
      if (op == "GroupQueryAttention") {
        take = kv && kv_float;
      } else if (op == "MatMulNBits") {
        take = manifest.precision == "int4";
        if (take && by_cpu && !(cpu_why = detail::matmul_not_chosen()).empty()) {
          cpu_why = "MatMulNBits: " + cpu_why;
          continue;
        }
      } else {
        throw std::invalid_argument("kernel_ops: no edgeattn kernel for " + op +
                                    " (GroupQueryAttention, MatMulNBits)");
      }
      (take ? ops : skipped) += (take ? ops : skipped).empty() ? op : "," + op;
    }
    if (!skipped.empty()) kernels_why = skipped + ": not in this artifact in the form the kernels take";
    if (!cpu_why.empty()) kernels_why += (kernels_why.empty() ? "" : "; ") + cpu_why;
    return ops;
  }

  size_t item_bytes(size_t i) const { return detail::state_item_bytes(manifest.state[i].dtype); }
  size_t bytes(size_t i) const { return static_cast<size_t>(detail::numel(shapes[i])) * item_bytes(i); }

  // The reduced KV buffer slots that a state holds: its largest "position" value, rounded up (GroupQueryAttention
  // reads and writes no slot at or past it), as Python's OnnxRuntimeSession._filled; every slot when the artifact
  // has no position entry. `values[i]`: entry i's float32 values (only the position entries' are read).
  int64_t filled(const std::vector<const float*>& values) const {
    double n = -1;
    int64_t slots = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (manifest.state[i].dtype != "float32") slots = std::max(slots, shapes[i][2]);  // [B, H, L, D]
      if (manifest.state[i].name != "position" || !values[i]) continue;
      n = std::max(n, 0.0);
      for (int64_t k = 0; k < detail::numel(shapes[i]); ++k) n = std::max(n, static_cast<double>(values[i][k]));
    }
    return n < 0 ? slots : std::min(slots, static_cast<int64_t>(std::ceil(n)));
  }

  // Map the manifest's weights file once and make one OrtValue per tensor, under each of its names.
  void map_weights() {
    const WeightsInfo& w = manifest.weights;
    const std::string path = manifest.dir + "/" + w.path;
    weights_file = std::make_unique<detail::MappedFile>(path);
    for (const WeightTensor& t : w.tensors) {
      if (static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(t.length) > weights_file->size())
        throw ManifestError(path + ": tensor " + t.names[0] + " lies outside the file (manifest and file disagree)");
      for (const std::string& name : t.names)
        weights.emplace_back(name, Ort::Value::CreateTensor(cpu, weights_file->data() + t.offset,
                                                            static_cast<size_t>(t.length), t.shape.data(),
                                                            t.shape.size(), detail::element_type(t.dtype)));
    }
    prepacked = Ort::PrepackedWeightsContainer();
  }

  void open(detail::Graph& g, const GraphInfo& info, const SessionOptions& options, detail::Graph* same = nullptr) {
    g.file = info.path;
    g.tokens = info.tokens;
    if (g.tokens == 0) return;
    if (same != nullptr) {  // one graph file for both: one session, its own ids, logits and bindings
      g.session = same->session;
      g.shares_session = true;
      detail::check_io(g, manifest, shapes);
      g.allocator = Ort::Allocator(*g.session, cpu);
      g.ids = detail::zeros<int64_t>(g.allocator, {1, g.tokens});
      g.logits = detail::zeros<float>(g.allocator, {1, logit_rows(g), manifest.vocab_size});
      return;
    }
    auto make = [&](const std::string& ops) {
      Ort::SessionOptions so;
      so.SetIntraOpNumThreads(options.threads);
      so.SetInterOpNumThreads(1);
      so.SetExecutionMode(ORT_SEQUENTIAL);
      so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
      so.EnableCpuMemArena();
      so.SetLogSeverityLevel(options.log_level);
      for (const auto& [name, value] : weights) so.AddInitializer(name.c_str(), value);
      if (!options.kernels_library.empty()) {  // loaded even for no op, so that a bad path is an error
        so.AddConfigEntry("edgeattn.ops", ops.c_str());
        try {
          so.RegisterCustomOpsLibrary(options.kernels_library.c_str());
        } catch (const Ort::Exception& e) {
          throw std::runtime_error("cannot load the kernels library " + options.kernels_library + ": " +
                                   detail::one_line(e.what()));
        }
      }
      return so;
    };
    const std::string path = manifest.dir + "/" + info.path;
    // edgeattn's kernels where asked for and they apply (the step graph decides for both); a graph that does not
    // load with them loads with ONNX Runtime's
    const std::string ops = options.kernels_library.empty() ? "" : &g == &step ? kernel_ops(options) : kernels;
    // all of them, else one at a time (the first that loads), else none: as Python's OnnxRuntimeSession
    std::vector<std::string> attempts = detail::split_commas(ops);
    if (attempts.size() > 1) attempts.insert(attempts.begin(), ops);
    bool loaded = false;
    for (const std::string& attempt : attempts) {
      Ort::SessionOptions so = make(attempt);
      try {
        g.own = prepacked ? Ort::Session(env, path.c_str(), so, prepacked) : Ort::Session(env, path.c_str(), so);
        loaded = true;
        if (&g == &step) kernels = attempt;  // (the prefill graph loads with the step graph's, or alone without)
        break;
      } catch (const Ort::Exception& e) {
        if (kernels_why.find(" did not load with ") == std::string::npos)
          kernels_why += (kernels_why.empty() ? "" : "; ") + info.path + " did not load with " + attempt + ": " +
                         detail::one_line(e.what());
      }
    }
    if (&g == &step && !loaded) kernels.clear();
    if (!loaded) {
      Ort::SessionOptions so = make("");
      try {
        g.own = prepacked ? Ort::Session(env, path.c_str(), so, prepacked) : Ort::Session(env, path.c_str(), so);
      } catch (const Ort::Exception& e) {
        throw ManifestError("ONNX Runtime cannot load " + path + ": " + detail::one_line(e.what()));
      }
    }
    g.session = &g.own;
    detail::check_io(g, manifest, shapes);
    g.allocator = Ort::Allocator(*g.session, cpu);
    g.ids = detail::zeros<int64_t>(g.allocator, {1, g.tokens});
    g.logits = detail::zeros<float>(g.allocator, {1, logit_rows(g), manifest.vocab_size});
  }

  void bind(detail::Graph& g) {
    if (g.tokens == 0) return;
    for (int p = 0; p < 2; ++p) {
      Ort::IoBinding b(*g.session);
      b.BindInput(manifest.input_ids_name.c_str(), g.ids);
      b.BindOutput(manifest.logits_name.c_str(), g.logits);
      for (size_t i = 0; i < manifest.state.size(); ++i) {
        b.BindInput(manifest.state[i].input.c_str(), state[p][i]);
        b.BindOutput(manifest.state[i].output.c_str(), state[1 - p][i]);
      }
      g.binding[p] = std::move(b);
    }
  }

  // The rows of a call's logits: one with "prefill_logits" "last", else one per token.
  int64_t logit_rows(const detail::Graph& g) const { return manifest.last_logits ? 1 : g.tokens; }

  // Run `g` on ids[begin, begin + g.tokens): reads state[cur], writes state[1 - cur], then swaps.
  const float* run(detail::Graph& g, const int64_t* ids) {
    std::copy(ids, ids + g.tokens, g.ids.GetTensorMutableData<int64_t>());
    try {
      g.session->Run(run_options, g.binding[cur]);
    } catch (const Ort::Exception& e) {
      throw RuntimeError("ONNX Runtime failed to run " + g.file + ": " + detail::one_line(e.what()));
    }
    cur = 1 - cur;
    position += g.tokens;
    return g.logits.GetTensorData<float>() + (logit_rows(g) - 1) * manifest.vocab_size;
  }

  void check_tokens(const int64_t* ids, size_t n) const {
    for (size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= manifest.vocab_size)
        throw InputError("token " + std::to_string(ids[i]) + " is out of range: the vocabulary has " +
                         std::to_string(manifest.vocab_size) + " tokens (0.." +
                         std::to_string(manifest.vocab_size - 1) + ")");
    if (manifest.max_length >= 0 && position + static_cast<int64_t>(n) > manifest.max_length)
      throw InputError("max_length " + std::to_string(manifest.max_length) + " exceeded: " +
                       std::to_string(position) + " tokens consumed, " + std::to_string(n) +
                       " more given (the softmax baseline's KV buffer holds max_length tokens: reset, or use a "
                       "linear-attention model)");
  }
};

}  // namespace edgeattn
