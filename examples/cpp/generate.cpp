// generate: text generation with an exported edgeattn artifact, from C++.
//
//   generate ARTIFACT_DIR (--prompt TEXT | --prompt-ids IDS) [-n 200] [--temperature T] [--top-k K] [--top-p P] [--seed S]
//            [--state-in FILE] [--state-out FILE] [--threads N] [--dump-logits FILE.npy] [--no-share-weights]
//            [--kernels LIB [--kernel-ops LIST]]
//
// --kernels: edgeattn's CPU kernels library (`python -m edgeattn.runtimes.attention` builds it for this CPU and prints
// its path), registered for the ops this artifact has in the forms it takes, chosen by the CPU as Python's sessions
// choose them, or those of --kernel-ops (GroupQueryAttention,MatMulNBits; SessionOptions::kernel_ops) on any CPU
// (stderr and the JSON line say which).
//
// Byte-level artifacts (no "tokenizer" in the manifest): the prompt's bytes are the token ids and each generated
// token is printed as one byte (vocab <= 256). Artifacts with a Hugging Face tokenizer.json: this example takes and
// returns token ids (--prompt-ids "12,7,99"; stdout gets the generated ids, space-separated), because no maintained
// C/C++ library that reads tokenizer.json is installable here (Debian has sentencepiece, another format; the
// onnxruntime-genai wheel exports a tokenizer C API but ships no headers). Generation stops at the manifest's
// tokenizer.eos_token_ids: the EOS is consumed (as Python's Session.generate_ids does) but not printed.
// stdout gets the prompt and then the text as it is produced; stderr gets the speed, the ONNX Runtime arena's
// peak bytes in use (at generated token 128 and at the last one), the process's resident memory (VmRSS from
// /proc/self/status, Linux) before the first generated token and after the last, and a final JSON line for programs.
//
// --state-in resumes from a state file before the prompt; --state-out saves the state after the prompt and every
// printed token. --dump-logits writes a float32 .npy [rows, vocab]: row i holds the logits token i was drawn from
// (rows: the tokens printed, plus one for the EOS when generation stopped there).
// Temperature 0 (the default) is greedy. Any error: one line on stderr and exit code 1 (2 for bad arguments).
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "edgeattn/session.hpp"
#include "example_util.hpp"

namespace {

const char* kUsage =
    "usage: generate ARTIFACT_DIR (--prompt TEXT | --prompt-ids IDS) [-n 200] [--temperature T] [--top-k K] [--top-p P] [--seed S] "
    "[--state-in FILE] [--state-out FILE] [--threads N] [--dump-logits FILE] [--no-share-weights] [--kernels LIB [--kernel-ops LIST]]";

bool g_printed = false;  // stdout has text without a final newline

using example::check_output_file;
using example::one_line;
using example::parse_number;
using example::resident_bytes;
using example::UsageError;

// The options that take a value (--flag VALUE or --flag=VALUE); any other option is unknown.
const std::set<std::string> kValueOptions = {"--prompt",      "--prompt-ids", "-n",        "--temperature",
                                             "--top-k",       "--top-p",      "--seed",    "--state-in",
                                             "--state-out",   "--threads",    "--dump-logits", "--kernels",
                                             "--kernel-ops"};

struct Args {
  std::string artifact, prompt, state_in, state_out, dump_logits, kernels, kernel_ops;
  bool has_prompt = false;
  std::vector<int64_t> prompt_ids;  // --prompt-ids
  int64_t n = 200;
  int threads = 0;
  bool share_weights = true;
  edgeattn::SamplingOptions sampling;
};

// "12,7,99" or "12 7 99" -> {12, 7, 99}
std::vector<int64_t> parse_ids(const std::string& flag, const std::string& value) {
  std::vector<int64_t> ids;
  std::string cur;
  for (size_t i = 0; i <= value.size(); ++i) {
    const char c = i < value.size() ? value[i] : ',';
    if (c == ',' || c == ' ') {
      if (!cur.empty()) ids.push_back(parse_number<int64_t>(flag, cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (ids.empty()) throw UsageError(flag + " needs at least one token id");
  return ids;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "-h" || flag == "--help") {
      std::printf("%s\n", kUsage);
      std::exit(0);
    }
    if (flag == "--no-share-weights") {
      a.share_weights = false;
      continue;
    }
    if (flag.rfind("-", 0) != 0) {
      if (!a.artifact.empty()) throw UsageError("unexpected argument '" + flag + "'");
      a.artifact = flag;
      continue;
    }
    const auto eq = flag.rfind("--", 0) == 0 ? flag.find('=') : std::string::npos;
    if (!kValueOptions.count(flag.substr(0, eq))) throw UsageError("unknown option " + flag.substr(0, eq));
    if (eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else {
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "--prompt") a.prompt = value, a.has_prompt = true;
    else if (flag == "--prompt-ids") a.prompt_ids = parse_ids(flag, value);
    else if (flag == "-n") a.n = parse_number<int64_t>(flag, value);
    else if (flag == "--temperature") a.sampling.temperature = parse_number<float>(flag, value);
    else if (flag == "--top-k") a.sampling.top_k = parse_number<int>(flag, value);
    else if (flag == "--top-p") a.sampling.top_p = parse_number<float>(flag, value);
    else if (flag == "--seed") a.sampling.seed = parse_number<uint64_t>(flag, value);
    else if (flag == "--state-in") a.state_in = value;
    else if (flag == "--state-out") a.state_out = value;
    else if (flag == "--threads") a.threads = parse_number<int>(flag, value);
    else if (flag == "--dump-logits") a.dump_logits = value;
    else if (flag == "--kernels") a.kernels = value;
    else if (flag == "--kernel-ops") a.kernel_ops = value;
  }
  if (a.artifact.empty()) throw UsageError("missing ARTIFACT_DIR");
  if (!a.kernel_ops.empty() && a.kernels.empty()) throw UsageError("--kernel-ops needs --kernels LIB");
  if (a.has_prompt && !a.prompt_ids.empty()) throw UsageError("give --prompt or --prompt-ids, not both");
  if ((!a.has_prompt || a.prompt.empty()) && a.prompt_ids.empty())
    throw UsageError("--prompt TEXT or --prompt-ids IDS is required (generation starts from the logits of its last token)");
  if (a.n < 1) throw UsageError("-n must be >= 1");
  if (a.threads < 0) throw UsageError("--threads must be >= 0");
  // output files are checked before anything runs, so a typo does not cost the whole generation
  if (!a.state_out.empty()) check_output_file(a.state_out, "--state-out");
  if (!a.dump_logits.empty()) check_output_file(a.dump_logits, "--dump-logits");
  return a;
}

// A float32 .npy [rows, cols] written row by row.
class NpyWriter {
 public:
  // At most max_rows rows; the header is written again with the rows written when the file is closed.
  NpyWriter(const std::string& path, int64_t max_rows, int64_t cols)
      : path_(path), cols_(cols), f_(std::fopen(path.c_str(), "wb")) {
    if (!f_) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    total_ = (10 + dict(max_rows).size() + 1 + 63) / 64 * 64;  // magic + version + length + dict + '\n'
    header(max_rows);
  }
  ~NpyWriter() {
    if (f_) std::fclose(f_);
  }
  void row(const std::vector<float>& values) {
    write(values.data(), values.size() * sizeof(float));
    ++rows_;
  }
  void close() {
    if (std::fseek(f_, 0, SEEK_SET) != 0) throw std::runtime_error("cannot write " + path_);
    header(rows_);
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) throw std::runtime_error("cannot write " + path_);
  }

 private:
  std::string dict(int64_t rows) const {
    return "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
           std::to_string(cols_) + "), }";
  }
  void header(int64_t rows) {
    std::string d = dict(rows);
    d.append(total_ - 10 - d.size() - 1, ' ');
    d += '\n';
    const uint16_t len = static_cast<uint16_t>(d.size());
    const unsigned char head[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<unsigned char>(len & 0xff),
                                    static_cast<unsigned char>(len >> 8)};
    write(head, sizeof(head));
    write(d.data(), d.size());
  }
  void write(const void* data, size_t n) {
    if (std::fwrite(data, 1, n, f_) != n) throw std::runtime_error("cannot write " + path_);
  }
  std::string path_;
  int64_t cols_, rows_ = 0;
  size_t total_ = 0;
  FILE* f_;
};

std::string peak_str(int64_t bytes) { return bytes < 0 ? "unavailable" : std::to_string(bytes) + " bytes"; }
std::string json_int(int64_t v) { return v < 0 ? "null" : std::to_string(v); }

int run(const Args& a) {
  using clock = std::chrono::steady_clock;
  edgeattn::SessionOptions options;
  options.threads = a.threads;
  options.share_weights = a.share_weights;
  options.kernels_library = a.kernels;
  options.kernel_ops = a.kernel_ops;
  edgeattn::Session sess(a.artifact, options);
  if (!a.kernels.empty())
    std::fprintf(stderr, "edgeattn's kernels: %s%s%s\n", sess.kernels().empty() ? "none" : sess.kernels().c_str(),
                 sess.kernels_why().empty() ? "" : "; ", sess.kernels_why().c_str());
  const edgeattn::TokenizerInfo& tok = sess.manifest().tokenizer;
  const bool text = a.has_prompt;  // bytes in and out; else token ids in and out
  if (text && !tok.byte_level())
    throw UsageError("this artifact's tokenizer is " + tok.path +
                     " (Hugging Face), which this example cannot encode: pass the prompt's token ids with --prompt-ids");
  if (text && sess.vocab_size() > 256)
    throw std::runtime_error("--prompt is byte-level (vocab <= 256); the artifact has vocab_size " +
                             std::to_string(sess.vocab_size()) + ": pass token ids with --prompt-ids");
  edgeattn::Sampler sampler(a.sampling);
  if (!a.state_in.empty()) sess.load_state(a.state_in);

  std::vector<int64_t> prompt = a.prompt_ids;
  if (text) {
    for (unsigned char c : a.prompt) prompt.push_back(c);
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fflush(stdout);
    g_printed = true;
  }

  const auto t0 = clock::now();
  std::vector<float> logits = sess.prefill(prompt);
  const auto t1 = clock::now();

  NpyWriter* dump = nullptr;
  std::unique_ptr<NpyWriter> dump_owner;
  if (!a.dump_logits.empty()) dump = (dump_owner = std::make_unique<NpyWriter>(a.dump_logits, a.n, sess.vocab_size())).get();

  const int64_t rss_start = resident_bytes();  // the session is open and the prompt consumed
  int64_t peak_at_128 = -1, generated = 0;
  bool stopped_at_eos = false;
  for (int64_t i = 1; i <= a.n; ++i) {
    if (dump) dump->row(logits);
    const int64_t token = sampler.sample(logits);
    if (tok.is_eos(token)) {  // consumed, not printed: the state is that of the text ended by its EOS
      sess.step(token);
      stopped_at_eos = true;
      break;
    }
    if (text) {
      const char byte = static_cast<char>(token);
      std::fwrite(&byte, 1, 1, stdout);
    } else {
      std::fprintf(stdout, "%s%lld", generated ? " " : "", static_cast<long long>(token));
    }
    g_printed = true;
    std::fflush(stdout);
    ++generated;
    logits = sess.step(token);  // every printed token is consumed, so --state-out covers the whole text
    if (i == 128) {
      auto stats = sess.memory_stats();
      peak_at_128 = stats.available ? stats.max_in_use : -1;
    }
  }
  const auto t2 = clock::now();
  const int64_t rss_last = resident_bytes();
  if (dump) dump->close();
  if (!a.state_out.empty()) sess.save_state(a.state_out);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  g_printed = false;

  const auto stats = sess.memory_stats();
  const int64_t peak_last = stats.available ? stats.max_in_use : -1;
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const int64_t steps = generated + (stopped_at_eos ? 1 : 0);  // tokens sampled and consumed
  const double tps = steps ? steps / decode_s : 0.0;
  const double us = steps ? 1e6 * decode_s / steps : 0.0;
  std::fprintf(stderr, "%lld tokens in %.4f s: %.1f tokens/s (%.2f us/token); prompt %zu tokens in %.4f s%s\n",
               static_cast<long long>(generated), decode_s, tps, us, prompt.size(), prefill_s,
               stopped_at_eos ? "; stopped at EOS" : "");
  std::fprintf(stderr, "onnxruntime peak bytes in use: %s at token 128, %s at token %lld\n",
               generated >= 128 ? peak_str(peak_at_128).c_str() : "n/a", peak_str(peak_last).c_str(),
               static_cast<long long>(generated));
  std::fprintf(stderr, "resident memory: %s before the first token, %s after token %lld\n", peak_str(rss_start).c_str(),
               peak_str(rss_last).c_str(), static_cast<long long>(generated));
  std::fprintf(stderr,
               "{\"tokens\": %lld, \"prompt_tokens\": %zu, \"decode_s\": %.6f, \"prefill_s\": %.6f, "
               "\"tokens_per_s\": %.2f, \"us_per_token\": %.3f, \"peak_bytes_at_128\": %s, \"peak_bytes_at_last\": %s, "
               "\"rss_bytes_start\": %s, \"rss_bytes_last\": %s, \"position\": %lld, \"stopped_at_eos\": %s, "
               "\"kernels\": \"%s\"}\n",
               static_cast<long long>(generated), prompt.size(), decode_s, prefill_s, tps, us,
               json_int(peak_at_128).c_str(), json_int(peak_last).c_str(), json_int(rss_start).c_str(),
               json_int(rss_last).c_str(), static_cast<long long>(sess.position()), stopped_at_eos ? "true" : "false",
               sess.kernels().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "generate: error: %s (see --help)\n", one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) {
    if (g_printed) std::fputc('\n', stdout);  // end the partial text line
    std::fflush(stdout);
    std::fprintf(stderr, "generate: error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
