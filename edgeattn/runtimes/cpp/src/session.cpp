// edgeattn::Session: the step and prefill graphs of an artifact on ONNX Runtime, with the state kept in two
// ONNX Runtime buffers per state tensor that IoBinding swaps between calls.
//
// Weights: in an fp32 artifact with a shared weights file (the manifest's "weights"), the file is mapped once and
// every tensor handed to both sessions as the same OrtValue (SessionOptions::AddInitializer), and both sessions
// are created with one Ort::PrepackedWeightsContainer, so each matrix is prepacked once for both. When step and
// prefill name the same graph file (one graph with a dynamic token axis), one session serves both.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

// The API is initialised in ort_api() below, so a runtime older than the headers is an exception, not a crash.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "edgeattn/session.hpp"
#include "state_file.hpp"

namespace edgeattn {
namespace {

void ort_api() {
  static const OrtApi* api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (!api)
    throw RuntimeError(std::string("the ONNX Runtime library is version ") + OrtGetApiBase()->GetVersionString() +
                       ", older than the headers this runtime was built with (C API " +
                       std::to_string(ORT_API_VERSION) + "): rebuild against older headers or a newer library");
  Ort::InitApi(api);
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
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
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IntegrityError("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
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
  size_t size() const { return size_; }

 private:
  void* data_ = MAP_FAILED;
  size_t size_ = 0;
};

ONNXTensorElementDataType element_type(const std::string& dtype) {
  if (dtype == "float32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (dtype == "float16") return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  if (dtype == "float64") return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
  if (dtype == "int8") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  if (dtype == "uint8") return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  if (dtype == "int32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  if (dtype == "int64") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  throw ManifestError("weights tensor of unknown dtype " + dtype);
}

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
  Ort::Value logits{nullptr};  // [1, tokens, vocab] float
  Ort::IoBinding binding[2] = {Ort::IoBinding{nullptr}, Ort::IoBinding{nullptr}};
};

// Check a graph's inputs and outputs against the manifest before anything runs, so a mismatch names the tensor.
void check_io(const Graph& g, const Manifest& m, const std::vector<std::vector<int64_t>>& shapes) {
  Ort::AllocatorWithDefaultOptions names;
  std::unordered_map<std::string, Ort::TypeInfo> inputs, outputs;
  for (size_t i = 0; i < g.session->GetInputCount(); ++i)
    inputs.emplace(g.session->GetInputNameAllocated(i, names).get(), g.session->GetInputTypeInfo(i));
  for (size_t i = 0; i < g.session->GetOutputCount(); ++i)
    outputs.emplace(g.session->GetOutputNameAllocated(i, names).get(), g.session->GetOutputTypeInfo(i));

  auto expect = [&](std::unordered_map<std::string, Ort::TypeInfo>& io, const std::string& name, const char* kind,
                    ONNXTensorElementDataType type, const std::vector<int64_t>& shape) {
    auto it = io.find(name);
    if (it == io.end()) throw ManifestError(g.file + " has no " + kind + " named " + name + " (listed in edgeattn.json)");
    auto info = it->second.GetTensorTypeAndShapeInfo();
    if (info.GetElementType() != type)
      throw ManifestError(g.file + ": " + kind + " " + name + " has another element type than the manifest says");
    std::vector<int64_t> dims = info.GetShape();
    bool ok = dims.size() == shape.size();
    for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] < 0 || dims[i] == shape[i];
    if (!ok) throw ManifestError(g.file + ": " + kind + " " + name + " does not take the shape " + shape_str(shape));
    io.erase(it);
  };
  expect(inputs, m.input_ids_name, "input", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, {1, g.tokens});
  expect(outputs, m.logits_name, "output", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, {1, g.tokens, m.vocab_size});
  for (size_t i = 0; i < m.state.size(); ++i) {
    expect(inputs, m.state[i].input, "input", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, shapes[i]);
    expect(outputs, m.state[i].output, "output", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, shapes[i]);
  }
  if (!inputs.empty())
    throw ManifestError(g.file + " has the input " + inputs.begin()->first + ", which edgeattn.json does not list");
}

}  // namespace

struct Session::Impl {
  Manifest manifest;
  Ort::Env env{nullptr};
  Ort::MemoryInfo cpu{nullptr};
  Ort::RunOptions run_options{nullptr};
  // The shared weights and their prepacked forms, declared before the graphs: the sessions go first.
  std::unique_ptr<MappedFile> weights_file;
  std::vector<std::pair<std::string, Ort::Value>> weights;  // initializer name -> tensor over weights_file
  Ort::PrepackedWeightsContainer prepacked{nullptr};
  Graph step, prefill;
  std::vector<std::vector<int64_t>> shapes;
  // Declared after the graphs: destroyed before the allocator they came from.
  std::vector<Ort::Value> state[2];
  int cur = 0;  // state[cur] holds the current state
  int64_t position = 0;

  // Map the manifest's weights file once and make one OrtValue per tensor, under each of its names.
  void map_weights() {
    const WeightsInfo& w = manifest.weights;
    const std::string path = manifest.dir + "/" + w.path;
    weights_file = std::make_unique<MappedFile>(path);
    for (const WeightTensor& t : w.tensors) {
      if (static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(t.length) > weights_file->size())
        throw ManifestError(path + ": tensor " + t.names[0] + " lies outside the file (manifest and file disagree)");
      for (const std::string& name : t.names)
        weights.emplace_back(name, Ort::Value::CreateTensor(cpu, weights_file->data() + t.offset,
                                                            static_cast<size_t>(t.length), t.shape.data(),
                                                            t.shape.size(), element_type(t.dtype)));
    }
    prepacked = Ort::PrepackedWeightsContainer();
  }

  void open(Graph& g, const GraphInfo& info, const SessionOptions& options, Graph* same = nullptr) {
    g.file = info.path;
    g.tokens = info.tokens;
    if (g.tokens == 0) return;
    if (same != nullptr) {  // one graph file for both: one session, its own ids, logits and bindings
      g.session = same->session;
      g.shares_session = true;
      check_io(g, manifest, shapes);
      g.allocator = Ort::Allocator(*g.session, cpu);
      g.ids = zeros<int64_t>(g.allocator, {1, g.tokens});
      g.logits = zeros<float>(g.allocator, {1, g.tokens, manifest.vocab_size});
      return;
    }
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(options.threads);
    so.SetInterOpNumThreads(1);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    so.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    so.EnableCpuMemArena();
    so.SetLogSeverityLevel(options.log_level);
    for (const auto& [name, value] : weights) so.AddInitializer(name.c_str(), value);
    const std::string path = manifest.dir + "/" + info.path;
    try {
      g.own = prepacked ? Ort::Session(env, path.c_str(), so, prepacked) : Ort::Session(env, path.c_str(), so);
    } catch (const Ort::Exception& e) {
      throw ManifestError("ONNX Runtime cannot load " + path + ": " + one_line(e.what()));
    }
    g.session = &g.own;
    check_io(g, manifest, shapes);
    g.allocator = Ort::Allocator(*g.session, cpu);
    g.ids = zeros<int64_t>(g.allocator, {1, g.tokens});
    g.logits = zeros<float>(g.allocator, {1, g.tokens, manifest.vocab_size});
  }

  void bind(Graph& g) {
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

  // Run `g` on ids[begin, begin + g.tokens): reads state[cur], writes state[1 - cur], then swaps.
  const float* run(Graph& g, const int64_t* ids) {
    std::copy(ids, ids + g.tokens, g.ids.GetTensorMutableData<int64_t>());
    try {
      g.session->Run(run_options, g.binding[cur]);
    } catch (const Ort::Exception& e) {
      throw RuntimeError("ONNX Runtime failed to run " + g.file + ": " + one_line(e.what()));
    }
    cur = 1 - cur;
    position += g.tokens;
    return g.logits.GetTensorData<float>() + (g.tokens - 1) * manifest.vocab_size;
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

Session::Session(const std::string& artifact_dir, const SessionOptions& options) : impl_(std::make_unique<Impl>()) {
  ort_api();
  Impl& s = *impl_;
  s.manifest = Manifest::load(artifact_dir, options.verify_files);
  const Manifest& m = s.manifest;
  if (m.batch_size != 1)
    throw ManifestError(artifact_dir + " was exported for batch_size " + std::to_string(m.batch_size) +
                        "; the C++ runtime runs batch 1");
  for (const StateEntry& e : m.state) {
    if (e.dynamic())
      throw ManifestError("state " + e.input +
                          " has a dynamic dimension (a growing KV cache: the softmax baseline); the C++ runtime "
                          "runs fixed-size state only: export a fixed-size mixer (e.g. swa) or use the Python session");
    s.shapes.push_back(e.fixed_shape());
  }
  try {
    s.env = Ort::Env(static_cast<OrtLoggingLevel>(options.log_level), "edgeattn");
    s.cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    s.run_options = Ort::RunOptions();
    if (options.share_weights && !m.weights.path.empty() && m.precision == "fp32") s.map_weights();
    s.open(s.step, m.step, options);
    s.open(s.prefill, m.prefill, options, m.prefill.path == m.step.path ? &s.step : nullptr);
    // A shared entry (a preallocated KV buffer) has one buffer: set 1 holds a second OrtValue over set 0's memory,
    // so both bindings read and write it in place and the swap changes nothing for it.
    for (size_t i = 0; i < s.shapes.size(); ++i) {
      s.state[0].push_back(zeros<float>(s.step.allocator, s.shapes[i]));
      if (m.state[i].shared)
        s.state[1].push_back(Ort::Value::CreateTensor<float>(
            s.cpu, s.state[0][i].GetTensorMutableData<float>(), static_cast<size_t>(numel(s.shapes[i])),
            s.shapes[i].data(), s.shapes[i].size()));
      else
        s.state[1].push_back(zeros<float>(s.step.allocator, s.shapes[i]));
    }
    s.bind(s.step);
    s.bind(s.prefill);
  } catch (const Ort::Exception& e) {
    throw RuntimeError("ONNX Runtime: " + one_line(e.what()));
  }
}

Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

std::vector<float> Session::prefill(const std::vector<int64_t>& tokens) {
  Impl& s = *impl_;
  if (tokens.empty()) throw InputError("prefill needs at least one token");
  s.check_tokens(tokens.data(), tokens.size());
  const float* logits = nullptr;
  size_t i = 0;
  for (; s.prefill.tokens > 0 && tokens.size() - i >= static_cast<size_t>(s.prefill.tokens); i += s.prefill.tokens)
    logits = s.run(s.prefill, tokens.data() + i);
  for (; i < tokens.size(); ++i) logits = s.run(s.step, tokens.data() + i);
  return std::vector<float>(logits, logits + s.manifest.vocab_size);
}

std::vector<float> Session::step(int64_t token) {
  Impl& s = *impl_;
  s.check_tokens(&token, 1);
  const float* logits = s.run(s.step, &token);
  return std::vector<float>(logits, logits + s.manifest.vocab_size);
}

void Session::reset() {
  Impl& s = *impl_;
  for (size_t i = 0; i < s.shapes.size(); ++i)
    std::memset(s.state[s.cur][i].GetTensorMutableData<float>(), 0,
                static_cast<size_t>(numel(s.shapes[i])) * sizeof(float));
  s.position = 0;
}

void Session::save_state(const std::string& path) const {
  const Impl& s = *impl_;
  std::vector<detail::StateTensorView> views;
  for (size_t i = 0; i < s.shapes.size(); ++i)
    views.push_back({s.manifest.state[i].input, s.shapes[i], s.state[s.cur][i].GetTensorData<float>()});
  detail::write_state_file(path, views, s.manifest.fingerprint, s.position);
}

void Session::load_state(const std::string& path) {
  Impl& s = *impl_;
  const Manifest& m = s.manifest;
  detail::LoadedState loaded = detail::read_state_file(path);
  if (loaded.fingerprint != m.fingerprint)
    throw StateFileError(path + " holds the state of another model: fingerprint " + loaded.fingerprint.substr(0, 16) +
                         "... != this artifact's " + m.fingerprint.substr(0, 16) + "...");
  std::vector<size_t> order;  // manifest entry i -> index in the file
  for (const StateEntry& e : m.state) {
    auto it = std::find(loaded.names.begin(), loaded.names.end(), e.input);
    if (it == loaded.names.end()) throw StateFileError(path + " does not match the artifact's state: it lacks " + e.input);
    order.push_back(static_cast<size_t>(it - loaded.names.begin()));
  }
  if (loaded.names.size() != m.state.size()) {
    std::set<std::string> known;
    for (const StateEntry& e : m.state) known.insert(e.input);
    for (const auto& name : loaded.names)
      if (!known.count(name)) throw StateFileError(path + " does not match the artifact's state: it has unknown " + name);
  }
  for (size_t i = 0; i < m.state.size(); ++i)
    if (loaded.shapes[order[i]] != s.shapes[i])
      throw StateFileError(path + ": state tensor " + m.state[i].input + " has shape " +
                           shape_str(loaded.shapes[order[i]]) + ", the artifact's is " + shape_str(s.shapes[i]));
  for (size_t i = 0; i < m.state.size(); ++i) {
    const auto& src = loaded.data[order[i]];
    std::memcpy(s.state[s.cur][i].GetTensorMutableData<float>(), src.data(), src.size() * sizeof(float));
  }
  s.position = loaded.position;
}

int64_t Session::position() const { return impl_->position; }
int64_t Session::vocab_size() const { return impl_->manifest.vocab_size; }
const Manifest& Session::manifest() const { return impl_->manifest; }

MemoryStats Session::memory_stats() const {
  MemoryStats out;
#if ORT_API_VERSION >= 23
  for (const Graph* g : {&impl_->step, &impl_->prefill}) {
    if (g->tokens == 0 || g->shares_session) continue;  // one session's arena counted once
    std::unordered_map<std::string, std::string> kv;
    try {
      kv = g->allocator.GetStats().GetKeyValuePairs();
    } catch (const Ort::Exception&) {
      return MemoryStats{};  // an allocator without statistics (no arena)
    }
    auto get = [&](const char* key) -> int64_t {
      auto it = kv.find(key);
      return it == kv.end() ? 0 : std::stoll(it->second);
    };
    if (kv.count("MaxInUse") == 0) return MemoryStats{};
    out.available = true;
    out.in_use += get("InUse");
    out.max_in_use += get("MaxInUse");
    out.total_allocated += get("TotalAllocated");
    out.num_allocs += get("NumAllocs");
  }
#endif
  return out;
}

}  // namespace edgeattn
