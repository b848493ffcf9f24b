// edgeattn C++ runtime: run an exported artifact (edgeattn.json + step.onnx + prefill.onnx) with ONNX Runtime.
//
//   edgeattn::Session sess("artifacts/gla-tiny");            // reads + verifies the manifest, opens both graphs
//   std::vector<float> logits = sess.prefill({72, 105});     // logits of the last token, [vocab]
//   edgeattn::Sampler sampler({/*temperature*/ 0.8f, /*top_k*/ 40, /*top_p*/ 0.95f, /*seed*/ 1});
//   int64_t token = sampler.sample(logits);
//   logits = sess.step(token);
//   sess.save_state("chat.state");  ...  sess.load_state("chat.state");
//
// The state lives in two ONNX Runtime buffers per state tensor, bound once with IoBinding; each call reads one set
// and writes the other, then the roles swap. No state is copied per token. The artifact format is described in
// docs/artifact-format.md; state files are the safetensors files of edgeattn/runtimes/state_file.py.
//
// Every error is an edgeattn::Error (a std::runtime_error) with a one-line message; nothing aborts.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace edgeattn {

// ---- errors ---------------------------------------------------------------------------------------------------

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Missing, unreadable or invalid edgeattn.json, a format_version newer than this runtime, graphs that do not match it.
struct ManifestError : Error {
  using Error::Error;
};
// A file listed in the manifest is missing or its sha256 differs.
struct IntegrityError : Error {
  using Error::Error;
};
// A state file that is not one, is corrupt, belongs to another model, or has other names/shapes.
struct StateFileError : Error {
  using Error::Error;
};
// A bad argument: token out of range, empty prompt, max_length exceeded, bad sampling settings.
struct InputError : Error {
  using Error::Error;
};
// ONNX Runtime failed (the message says which call and why).
struct RuntimeError : Error {
  using Error::Error;
};

// ---- manifest -------------------------------------------------------------------------------------------------

constexpr int kFormatVersion = 1;  // the newest artifact (manifest) format this runtime reads; state files: 2

struct StateEntry {
  std::string input;   // past_key_values.{layer}.{name}
  std::string output;  // present.{layer}.{name}
  int layer = 0;
  std::string name;
  std::vector<std::variant<int64_t, std::string>> shape;  // a string is a dynamic dimension
  std::string dtype;  // float32; a shared KV buffer float16 or int8 too
  // int8: the scales [Hkv * D] (row-major [Hkv][D]) of a [B, Hkv, max_length, D] buffer; a slot holds
  // clip(rint(x / scale), -128, 127) of the float32 value x (ONNX Runtime's PER_CHANNEL quantized cache)
  std::vector<float> scale;
  // One buffer bound as both the past input and the present output: a preallocated KV buffer of max_length
  // tokens that the graph (ONNX Runtime's GroupQueryAttention) updates in place.
  bool shared = false;
  bool dynamic() const;
  std::vector<int64_t> fixed_shape() const;  // throws ManifestError for a dynamic entry
};

// The manifest's "tokenizer" entry. Absent: byte-level (vocabulary 256, no special ids). "huggingface": a
// tokenizer.json in the artifact; this runtime does not read it (it takes and returns token ids) but honours its
// special ids: generation stops at an id in eos_token_ids.
struct TokenizerInfo {
  std::string type = "byte";  // "byte" or "huggingface"
  std::string path;           // tokenizer.json, relative to the artifact directory ("" for byte-level)
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;  // -1: none
  int64_t pad_token_id = -1;  // -1: none
  bool byte_level() const { return type == "byte"; }
  bool is_eos(int64_t token) const;
};

// The manifest's "weights": the graphs' large initializers stored once in one file (weights.bin), each tensor at a
// page-aligned offset, under every initializer name that uses it. Empty path: each graph holds its own weights.
struct WeightTensor {
  std::vector<std::string> names;
  std::string dtype;  // float32, float16, float64, int8, uint8, int32, int64
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t length = 0;  // bytes
};

struct WeightsInfo {
  std::string path;  // relative to the artifact directory; "" when the manifest has no "weights"
  int64_t bytes = 0;
  std::vector<WeightTensor> tensors;
};

struct GraphInfo {
  std::string path;  // relative to the artifact directory
  int64_t tokens = 0;
};

struct Manifest {
  std::string dir;
  int format_version = 0;
  std::string fingerprint;
  int64_t vocab_size = 0;
  int64_t batch_size = 0;
  bool dynamic_batch = false;  // the graphs take any batch (dimension 0 of ids, logits and state): Streams
  std::string target, precision;
  int64_t max_length = -1;  // -1: unbounded
  std::string input_ids_name = "input_ids";
  std::string logits_name = "logits";
  // "prefill_logits": "last" (the export's default on one-graph artifacts): every call returns its last
  // token's logits only, [B, 1, vocab]; false ("all"): every token's, [B, tokens, vocab]
  bool last_logits = false;
  GraphInfo step;
  GraphInfo prefill;  // tokens == 0: the artifact has no prefill graph
  std::vector<StateEntry> state;
  WeightsInfo weights;
  TokenizerInfo tokenizer;
  std::vector<std::pair<std::string, std::string>> files;  // name -> sha256 hex

  // Parse dir/edgeattn.json; with verify, check every listed file's sha256 (IntegrityError on a mismatch).
  static Manifest load(const std::string& dir, bool verify = true);
};

std::string sha256_hex(const std::string& path);  // lower-case hex digest of a file

// ---- session --------------------------------------------------------------------------------------------------

struct SessionOptions {
  int threads = 0;            // ONNX Runtime intra-op threads per graph; 0 lets ONNX Runtime choose
  bool verify_files = true;   // check the sha256 of every file listed in the manifest
  int log_level = 3;          // ONNX Runtime's OrtLoggingLevel: 2 warning, 3 error
  // fp32 artifacts with a shared weights file: map it once, hand each tensor to both graphs' sessions and prepack
  // each matrix once for both (Ort::PrepackedWeightsContainer). false: each session loads and prepacks its own copy.
  bool share_weights = true;
  // edgeattn's CPU kernels library (edgeattn/runtimes/attention.cc + matmul.cc; `python -m
  // edgeattn.runtimes.attention` builds it for this CPU and prints its path). Non-empty: registered on the sessions
  // for the ops of kernel_ops that the manifest has in the forms they take (GroupQueryAttention over float32 KV
  // buffers, MatMulNBits in an int4 artifact); a graph that does not load with it loads without it
  // (Session::kernels() says which, kernels_why() why not). Empty: ONNX Runtime's kernels.
  std::string kernels_library;
  // "" (the default): the choice Python's sessions make, GroupQueryAttention, and MatMulNBits on the CPU kinds it
  // was raced on (AVX2, AVX-VNNI, AVX-512 VNNI; not AMX or AVX-512 without VNNI). A comma list (GroupQueryAttention,
  // MatMulNBits): those ops on any CPU (as EDGEATTN_MATMUL=edgeattn).
  std::string kernel_ops;
};

// The ONNX Runtime CPU arena's statistics, summed over the step and prefill sessions. `available` is false when
// built against headers older than ONNX Runtime 1.23 (no Ort::Allocator::GetStats).
struct MemoryStats {
  bool available = false;
  int64_t in_use = 0;
  int64_t max_in_use = 0;
  int64_t total_allocated = 0;  // bytes the arenas reserved from the system
  int64_t num_allocs = 0;
};

class Session {
 public:
  explicit Session(const std::string& artifact_dir, const SessionOptions& options = {});
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Consume tokens: full chunks through prefill.onnx, the rest through step.onnx. Returns the last token's logits.
  std::vector<float> prefill(const std::vector<int64_t>& tokens);
  // Consume one token; returns its logits [vocab].
  std::vector<float> step(int64_t token);
  // Back to the initial (all-zero) state at position 0.
  void reset();

  // Write / read the state as a safetensors state file (docs/artifact-format.md), float32 throughout: a float16 or
  // int8 KV buffer's slots below the position are converted (int8 with its scales), as Python's sessions do.
  // load_state refuses a state of another model (fingerprint) or with other tensor names or shapes, and leaves the
  // session unchanged then.
  void save_state(const std::string& path) const;
  void load_state(const std::string& path);

  int64_t position() const;  // tokens consumed since the initial state
  int64_t vocab_size() const;
  const Manifest& manifest() const;
  MemoryStats memory_stats() const;
  // The ops edgeattn's kernels library runs in this session, comma-separated ("" for none: ONNX Runtime's), and
  // kernels_why() why not where SessionOptions::kernels_library was given.
  const std::string& kernels() const;
  const std::string& kernels_why() const;

 private:
  friend class Streams;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- sampling -------------------------------------------------------------------------------------------------

struct SamplingOptions {
  float temperature = 0.0f;  // <= 0: greedy (argmax, lowest id on ties)
  int top_k = 0;             // keep the k most likely tokens; 0: all
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p; 1: all
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options = {});
  int64_t sample(const std::vector<float>& logits);  // RuntimeError for NaN or inf logits: never sampled

 private:
  SamplingOptions opt_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int64_t>> scratch_;
};

// ---- many streams per step -------------------------------------------------------------------------------------

struct StreamOptions {
  SamplingOptions sampling;            // each stream has its own sampler and seed
  std::vector<int64_t> stop_ids;       // stop when one is sampled (consumed, not returned); empty: none
  bool stop_at_eos = true;             // also stop at the tokenizer's eos_token_ids
  int64_t max_new_tokens = -1;         // stop after this many tokens; -1: no limit
};

// One step of every live stream: the token each produced (stop tokens are not reported; the stream is done).
struct StreamToken {
  int64_t stream;
  int64_t token;
};

// N independent streams over one Session's graphs, stepped together: one step-graph call at batch N per token.
//
//   edgeattn::Session sess("artifacts/gla-dyn", {1});      // exported with --dynamic-batch
//   edgeattn::Streams streams(sess);
//   int64_t a = streams.add(prompt_a, {{/*temperature*/ 0.8f, 40, 0.95f, /*seed*/ 1}});
//   int64_t b = streams.add(prompt_b);                       // greedy
//   for (const auto& [stream, token] : streams.step()) ...   // one graph call for a and b
//   streams.drop(a);
//
// add() prefills the prompt alone at batch 1 through the session (from zeros or from a state file), then the stream
// joins the batch: its first token is drawn from the prompt's last logits on the next step(), as Session-driven
// decoding would. The live streams' states sit in two [N, ...] buffers per state tensor that the step graph reads and
// writes in turn; add() and drop() copy rows and rebind, step() writes N ids and runs. A stream that stops (stop id,
// max_new_tokens) leaves the batch and keeps its state until drop(). The Session is borrowed: it must outlive the
// Streams and stay where it is (not moved from), and add() and resume() reset its own state. Needs an artifact exported with --dynamic-batch (batch_size 1) and
// fixed-size state (no KV buffer: each stream would need its own length).
class Streams {
 public:
  explicit Streams(Session& session, int64_t max_streams = -1);  // -1: no limit
  ~Streams();
  Streams(Streams&&) noexcept;
  Streams& operator=(Streams&&) noexcept;
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;

  // Start a stream from `prompt` (non-empty), after the state in `state_file` when one is given. Returns its id.
  int64_t add(const std::vector<int64_t>& prompt, const StreamOptions& options = {}, const std::string& state_file = "");
  // Resume a stream as it was saved: its state file and the next-token logits [vocab] that came with it.
  int64_t resume(const std::string& state_file, const std::vector<float>& logits, const StreamOptions& options = {});
  // Sample each live stream's next token and run the step graph once on all of them.
  std::vector<StreamToken> step();
  void drop(int64_t stream);  // forget a stream, live or done; InputError for an unknown id

  std::vector<int64_t> live() const;  // ids of the streams the next step advances, in batch-row order
  size_t size() const;                // streams held, live or done
  bool done(int64_t stream) const;
  const std::vector<int64_t>& generated(int64_t stream) const;  // tokens produced, stop tokens excluded
  const std::vector<float>& logits(int64_t stream) const;       // its next-token logits [vocab]
  int64_t position(int64_t stream) const;                       // tokens its state has consumed
  void save_state(int64_t stream, const std::string& path) const;  // a state file Session::load_state reads
  int64_t state_bytes_per_stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace edgeattn
