// edgeattn::Session: the step and prefill graphs of an artifact on ONNX Runtime, with the state kept in two
// ONNX Runtime buffers per state tensor that IoBinding swaps between calls.
//
// Weights: in an fp32 artifact with a shared weights file (the manifest's "weights"), the file is mapped once and
// every tensor handed to both sessions as the same OrtValue (SessionOptions::AddInitializer), and both sessions
// are created with one Ort::PrepackedWeightsContainer, so each matrix is prepacked once for both. When step and
// prefill name the same graph file (one graph with a dynamic token axis), one session serves both.
#include <cmath>
#include <set>
#include <string>
#include <unordered_map>

#include "session_impl.hpp"
#include "state_file.hpp"

namespace edgeattn {
using detail::Graph;
using detail::numel;
using detail::one_line;
using detail::shape_str;
using detail::zeros;

namespace {

void ort_api() {
  static const OrtApi* api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (!api)
    throw RuntimeError(std::string("the ONNX Runtime library is version ") + OrtGetApiBase()->GetVersionString() +
                       ", older than the headers this runtime was built with (C API " +
                       std::to_string(ORT_API_VERSION) + "): rebuild against older headers or a newer library");
  Ort::InitApi(api);
}

}  // namespace

namespace detail {

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
  expect(outputs, m.logits_name, "output", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
         {1, m.last_logits ? 1 : g.tokens, m.vocab_size});
  for (size_t i = 0; i < m.state.size(); ++i) {
    expect(inputs, m.state[i].input, "input", element_type(m.state[i].dtype), shapes[i]);
    expect(outputs, m.state[i].output, "output", element_type(m.state[i].dtype), shapes[i]);
  }
  if (!inputs.empty())
    throw ManifestError(g.file + " has the input " + inputs.begin()->first + ", which edgeattn.json does not list");
}

static_assert(sizeof(Ort::Float16_t) == 2, "a float16 KV buffer is read as an array of Ort::Float16_t");

// Slots [0, n) of each [L, D] row of a [B, H, L, D] KV buffer: f(element index, scale index).
template <typename F>
void for_slots(const std::vector<int64_t>& shape, int64_t n, F f) {
  const int64_t B = shape[0], H = shape[1], L = shape[2], D = shape[3];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < D; ++d) f(((b * H + h) * L + t) * D + d, h * D + d);
}

void kv_to_float(const StateEntry& e, const std::vector<int64_t>& shape, const void* kv, int64_t n, float* out) {
  if (e.dtype == "int8") {
    const auto* q = static_cast<const int8_t*>(kv);
    for_slots(shape, n, [&](int64_t i, int64_t c) { out[i] = static_cast<float>(q[i]) * e.scale[c]; });
  } else {
    const auto* h = static_cast<const Ort::Float16_t*>(kv);
    for_slots(shape, n, [&](int64_t i, int64_t) { out[i] = h[i].ToFloat(); });
  }
}

void kv_from_float(const StateEntry& e, const std::vector<int64_t>& shape, const float* x, int64_t n, void* kv) {
  if (e.dtype == "int8") {
    auto* q = static_cast<int8_t*>(kv);
    for_slots(shape, n, [&](int64_t i, int64_t c) {
      // nearbyint rounds half to even in the default rounding mode, as numpy's rint (edgeattn.runtimes.base)
      q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[i] / e.scale[c]), -128.0f), 127.0f));
    });
  } else {
    auto* h = static_cast<Ort::Float16_t*>(kv);
    for_slots(shape, n, [&](int64_t i, int64_t) { h[i] = Ort::Float16_t(x[i]); });
  }
}

}  // namespace detail


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
    // so both bindings read and write it in place and the swap changes nothing for it. It is in the graph's element
    // type (float32, float16 or int8); every other state tensor is float32.
    for (size_t i = 0; i < s.shapes.size(); ++i) {
      const ONNXTensorElementDataType type = detail::element_type(m.state[i].dtype);
      s.state[0].push_back(zeros(s.step.allocator, s.shapes[i], type, s.item_bytes(i)));
      if (m.state[i].shared)
        s.state[1].push_back(Ort::Value::CreateTensor(s.cpu, s.state[0][i].GetTensorMutableRawData(), s.bytes(i),
                                                      s.shapes[i].data(), s.shapes[i].size(), type));
      else
        s.state[1].push_back(zeros<float>(s.step.allocator, s.shapes[i]));
    }
    s.bind(s.step);
    s.bind(s.prefill);
    // The sessions prepacked the matrices they multiply (one copy, in the container), reading the mapped file once:
    // drop those pages. What the graphs still read directly (embeddings, norms, biases) pages back in on first use.
    if (s.weights_file) s.weights_file->release();
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
  for (size_t i = 0; i < s.shapes.size(); ++i) std::memset(s.state[s.cur][i].GetTensorMutableRawData(), 0, s.bytes(i));
  s.position = 0;
}

void Session::save_state(const std::string& path) const {
  const Impl& s = *impl_;
  const Manifest& m = s.manifest;
  // A state file holds float32: a reduced KV buffer's filled slots converted, zeros past them (never read).
  std::vector<std::vector<float>> converted(s.shapes.size());
  std::vector<const float*> current;
  for (size_t i = 0; i < s.shapes.size(); ++i)
    current.push_back(m.state[i].dtype == "float32" ? s.state[s.cur][i].GetTensorData<float>() : nullptr);
  const int64_t n = s.filled(current);
  std::vector<detail::StateTensorView> views;
  for (size_t i = 0; i < s.shapes.size(); ++i) {
    if (!current[i]) {
      converted[i].assign(static_cast<size_t>(numel(s.shapes[i])), 0.0f);
      detail::kv_to_float(m.state[i], s.shapes[i], s.state[s.cur][i].GetTensorRawData(), n, converted[i].data());
      current[i] = converted[i].data();
    }
    views.push_back({m.state[i].input, s.shapes[i], current[i]});
  }
  detail::write_state_file(path, views, m.fingerprint, s.position);
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
  std::vector<const float*> values;
  for (size_t i = 0; i < m.state.size(); ++i) values.push_back(loaded.data[order[i]].data());
  const int64_t n = s.filled(values);
  for (size_t i = 0; i < m.state.size(); ++i) {
    void* dst = s.state[s.cur][i].GetTensorMutableRawData();
    if (m.state[i].dtype == "float32")
      std::memcpy(dst, values[i], s.bytes(i));
    else  // a reduced KV buffer: its filled slots only, as Python's set_state (the others are never read)
      detail::kv_from_float(m.state[i], s.shapes[i], values[i], n, dst);
  }
  s.position = loaded.position;
}

int64_t Session::position() const { return impl_->position; }
int64_t Session::vocab_size() const { return impl_->manifest.vocab_size; }
const Manifest& Session::manifest() const { return impl_->manifest; }
const std::string& Session::kernels() const { return impl_->kernels; }
const std::string& Session::kernels_why() const { return impl_->kernels_why; }

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
