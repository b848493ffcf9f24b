// edgeattn::Streams: N independent streams over one Session's step graph, stepped together at batch N.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "session_impl.hpp"
#include "state_file.hpp"

namespace edgeattn {
namespace {

struct Stream {
  Sampler sampler;
  std::vector<int64_t> stop;
  int64_t max_new_tokens = -1;
  std::vector<float> logits;  // [vocab], the next token's
  int64_t position = 0;
  std::vector<int64_t> generated;
  bool done = false;
  std::vector<std::vector<float>> parked;  // its state rows while it is not in the batch (one per state tensor)
};

}  // namespace

struct Streams::Impl {
  Session* session = nullptr;
  Session::Impl* s = nullptr;
  int64_t max_streams = -1;
  std::map<int64_t, Stream> streams;
  std::vector<int64_t> rows;  // stream id of each batch row
  int64_t next_id = 0;
  std::vector<std::vector<int64_t>> row_shapes;  // each state tensor's shape without its batch dimension
  std::vector<size_t> row_numel;

  // The batch: storage, then the OrtValues over it, then the bindings over those (destroyed in reverse).
  std::vector<std::vector<float>> buf[2];  // buf[p][i]: state tensor i, [N, ...]
  std::vector<int64_t> ids;                // [N, 1]
  std::vector<float> logits;               // [N, 1, vocab]
  std::vector<Ort::Value> vals[2];
  Ort::Value ids_val{nullptr}, logits_val{nullptr};
  Ort::IoBinding binding[2] = {Ort::IoBinding{nullptr}, Ort::IoBinding{nullptr}};
  int cur = 0;  // buf[cur] holds the current state

  const Manifest& manifest() const { return s->manifest; }

  Stream& get(int64_t id) {
    auto it = streams.find(id);
    if (it == streams.end()) throw InputError("no stream with id " + std::to_string(id));
    return it->second;
  }

  // Make `state` (per state tensor, the rows of the streams in `rows`, concatenated) the current batch and bind
  // the step graph to it: binding[p] reads buf[p] and writes buf[1 - p].
  void rebind(std::vector<std::vector<float>> state) {
    const int64_t n = static_cast<int64_t>(rows.size());
    const int64_t V = manifest().vocab_size;
    binding[0] = Ort::IoBinding{nullptr};
    binding[1] = Ort::IoBinding{nullptr};
    for (auto& v : vals) v.clear();
    ids_val = Ort::Value{nullptr};
    logits_val = Ort::Value{nullptr};
    buf[0] = std::move(state);
    buf[1].assign(buf[0].size(), {});
    for (size_t i = 0; i < buf[0].size(); ++i) buf[1][i].assign(buf[0][i].size(), 0.0f);
    cur = 0;
    ids.assign(static_cast<size_t>(n), 0);
    logits.assign(static_cast<size_t>(n * V), 0.0f);
    if (n == 0) return;
    const std::vector<int64_t> ids_shape{n, 1}, logits_shape{n, 1, V};
    ids_val = Ort::Value::CreateTensor<int64_t>(s->cpu, ids.data(), ids.size(), ids_shape.data(), ids_shape.size());
    logits_val = Ort::Value::CreateTensor<float>(s->cpu, logits.data(), logits.size(), logits_shape.data(),
                                                 logits_shape.size());
    for (int p = 0; p < 2; ++p)
      for (size_t i = 0; i < buf[p].size(); ++i) {
        std::vector<int64_t> shape{n};
        shape.insert(shape.end(), row_shapes[i].begin(), row_shapes[i].end());
        vals[p].push_back(
            Ort::Value::CreateTensor<float>(s->cpu, buf[p][i].data(), buf[p][i].size(), shape.data(), shape.size()));
      }
    const Manifest& m = manifest();
    for (int p = 0; p < 2; ++p) {
      Ort::IoBinding b(*s->step.session);
      b.BindInput(m.input_ids_name.c_str(), ids_val);
      b.BindOutput(m.logits_name.c_str(), logits_val);
      for (size_t i = 0; i < m.state.size(); ++i) {
        b.BindInput(m.state[i].input.c_str(), vals[p][i]);
        b.BindOutput(m.state[i].output.c_str(), vals[1 - p][i]);
      }
      binding[p] = std::move(b);
    }
  }

  // The current state of batch row r, one vector per state tensor.
  std::vector<std::vector<float>> row(size_t r) const {
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < row_numel.size(); ++i) {
      const float* src = buf[cur][i].data() + r * row_numel[i];
      out.emplace_back(src, src + row_numel[i]);
    }
    return out;
  }

  // The session's current (batch-1) state, one vector per state tensor.
  std::vector<std::vector<float>> session_state() const {
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < row_numel.size(); ++i) {
      const float* src = s->state[s->cur][i].GetTensorData<float>();
      out.emplace_back(src, src + row_numel[i]);
    }
    return out;
  }

  // Take the streams in `ids` out of the batch, each keeping its state rows.
  void park(const std::vector<int64_t>& leaving) {
    std::vector<int64_t> kept;
    std::vector<std::vector<float>> state(row_numel.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      if (std::find(leaving.begin(), leaving.end(), rows[r]) != leaving.end()) {
        streams.at(rows[r]).parked = row(r);
        continue;
      }
      kept.push_back(rows[r]);
      for (size_t i = 0; i < row_numel.size(); ++i) {
        const float* src = buf[cur][i].data() + r * row_numel[i];
        state[i].insert(state[i].end(), src, src + row_numel[i]);
      }
    }
    rows = std::move(kept);
    rebind(std::move(state));
  }

  // A new stream with the session's current state and `next_logits`; it joins the batch unless it is done already.
  int64_t start(std::vector<float> next_logits, const StreamOptions& options, Sampler sampler) {
    Stream st{std::move(sampler), options.stop_ids, options.max_new_tokens, std::move(next_logits),
              session->position(), {}, false, {}};
    if (options.stop_at_eos)
      st.stop.insert(st.stop.end(), manifest().tokenizer.eos_token_ids.begin(), manifest().tokenizer.eos_token_ids.end());
    const int64_t id = next_id++;
    std::vector<std::vector<float>> joining = session_state();
    if (options.max_new_tokens == 0) {
      st.done = true;
      st.parked = std::move(joining);
      streams.emplace(id, std::move(st));
      return id;
    }
    std::vector<std::vector<float>> state = buf[cur];
    for (size_t i = 0; i < state.size(); ++i) state[i].insert(state[i].end(), joining[i].begin(), joining[i].end());
    streams.emplace(id, std::move(st));
    rows.push_back(id);
    rebind(std::move(state));
    return id;
  }

  void check_options(const StreamOptions& options) const {
    if (options.max_new_tokens < -1) throw InputError("max_new_tokens must be >= 0 (or -1: no limit)");
    if (max_streams >= 0 && static_cast<int64_t>(rows.size()) >= max_streams)
      throw InputError(std::to_string(rows.size()) + " streams are live, max_streams is " + std::to_string(max_streams));
    for (int64_t id : options.stop_ids)
      if (id < 0 || id >= manifest().vocab_size)
        throw InputError("stop id " + std::to_string(id) + " is outside the vocabulary [0, " +
                         std::to_string(manifest().vocab_size) + ")");
  }
};

Streams::Streams(Session& session, int64_t max_streams) : impl_(std::make_unique<Impl>()) {
  Impl& t = *impl_;
  t.session = &session;
  t.s = session.impl_.get();
  t.max_streams = max_streams;
  const Manifest& m = t.manifest();
  if (!m.dynamic_batch)
    throw ManifestError(m.dir + " was exported with a fixed batch of " + std::to_string(m.batch_size) +
                        ": streams need graphs that take any batch; export again with --dynamic-batch");
  for (const StateEntry& e : m.state)
    if (e.shared)
      throw ManifestError("state " + e.input + " is a KV buffer (softmax attention, " + e.dtype +
                          "): streams take fixed-size recurrent state only; use a linear-attention model (or mixer "
                          "swa), or a Session per stream");
  if (max_streams == 0 || max_streams < -1) throw InputError("max_streams must be >= 1 (or -1: no limit)");
  for (const auto& shape : t.s->shapes) {
    t.row_shapes.emplace_back(shape.begin() + 1, shape.end());
    t.row_numel.push_back(static_cast<size_t>(detail::numel(t.row_shapes.back())));
  }
  t.buf[0].assign(t.row_numel.size(), {});
  t.rebind(t.buf[0]);
}

Streams::~Streams() = default;
Streams::Streams(Streams&&) noexcept = default;
Streams& Streams::operator=(Streams&&) noexcept = default;

int64_t Streams::add(const std::vector<int64_t>& prompt, const StreamOptions& options, const std::string& state_file) {
  Impl& t = *impl_;
  t.check_options(options);
  if (prompt.empty()) throw InputError("a stream needs a prompt of at least one token (or resume() a saved one)");
  Sampler sampler(options.sampling);  // checks the sampling settings before anything runs
  t.session->reset();
  if (!state_file.empty()) t.session->load_state(state_file);
  return t.start(t.session->prefill(prompt), options, std::move(sampler));
}

int64_t Streams::resume(const std::string& state_file, const std::vector<float>& logits, const StreamOptions& options) {
  Impl& t = *impl_;
  t.check_options(options);
  if (static_cast<int64_t>(logits.size()) != t.manifest().vocab_size)
    throw InputError("logits must have " + std::to_string(t.manifest().vocab_size) + " values (the vocabulary), got " +
                     std::to_string(logits.size()));
  Sampler sampler(options.sampling);
  t.session->reset();
  t.session->load_state(state_file);
  return t.start(logits, options, std::move(sampler));
}

std::vector<StreamToken> Streams::step() {
  Impl& t = *impl_;
  std::vector<StreamToken> out;
  if (t.rows.empty()) return out;
  const Manifest& m = t.manifest();
  std::vector<int64_t> stopped;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    Stream& st = t.streams.at(t.rows[r]);
    if (m.max_length >= 0 && st.position + 1 > m.max_length)
      throw InputError("max_length " + std::to_string(m.max_length) + " exceeded by stream " + std::to_string(t.rows[r]));
  }
  for (size_t r = 0; r < t.rows.size(); ++r) {
    Stream& st = t.streams.at(t.rows[r]);
    const int64_t token = st.sampler.sample(st.logits);
    t.ids[r] = token;
    if (std::find(st.stop.begin(), st.stop.end(), token) != st.stop.end()) {
      stopped.push_back(t.rows[r]);
      continue;
    }
    out.push_back({t.rows[r], token});
    st.generated.push_back(token);
    if (st.max_new_tokens >= 0 && static_cast<int64_t>(st.generated.size()) >= st.max_new_tokens)
      stopped.push_back(t.rows[r]);
  }
  try {
    t.s->step.session->Run(t.s->run_options, t.binding[t.cur]);
  } catch (const Ort::Exception& e) {
    throw RuntimeError("ONNX Runtime failed to run " + t.s->step.file + " at batch " + std::to_string(t.rows.size()) +
                       ": " + detail::one_line(e.what()));
  }
  t.cur = 1 - t.cur;
  const size_t V = static_cast<size_t>(m.vocab_size);
  for (size_t r = 0; r < t.rows.size(); ++r) {
    Stream& st = t.streams.at(t.rows[r]);
    st.logits.assign(t.logits.begin() + r * V, t.logits.begin() + (r + 1) * V);
    st.position += 1;
  }
  if (!stopped.empty()) {
    for (int64_t id : stopped) t.streams.at(id).done = true;
    t.park(stopped);
  }
  return out;
}

void Streams::drop(int64_t stream) {
  Impl& t = *impl_;
  t.get(stream);
  if (std::find(t.rows.begin(), t.rows.end(), stream) != t.rows.end()) t.park({stream});
  t.streams.erase(stream);
}

std::vector<int64_t> Streams::live() const { return impl_->rows; }
size_t Streams::size() const { return impl_->streams.size(); }
bool Streams::done(int64_t stream) const { return impl_->get(stream).done; }
const std::vector<int64_t>& Streams::generated(int64_t stream) const { return impl_->get(stream).generated; }
const std::vector<float>& Streams::logits(int64_t stream) const { return impl_->get(stream).logits; }
int64_t Streams::position(int64_t stream) const { return impl_->get(stream).position; }

void Streams::save_state(int64_t stream, const std::string& path) const {
  Impl& t = *impl_;
  const Stream& st = t.get(stream);
  auto it = std::find(t.rows.begin(), t.rows.end(), stream);
  const std::vector<std::vector<float>> state =
      it == t.rows.end() ? st.parked : t.row(static_cast<size_t>(it - t.rows.begin()));
  std::vector<detail::StateTensorView> views;
  for (size_t i = 0; i < state.size(); ++i) {
    std::vector<int64_t> shape{1};
    shape.insert(shape.end(), t.row_shapes[i].begin(), t.row_shapes[i].end());
    views.push_back({t.manifest().state[i].input, shape, state[i].data()});
  }
  detail::write_state_file(path, views, t.manifest().fingerprint, st.position);
}

int64_t Streams::state_bytes_per_stream() const {
  int64_t n = 0;
  for (size_t k : impl_->row_numel) n += static_cast<int64_t>(k * sizeof(float));
  return n;
}

}  // namespace edgeattn
