// streams: many byte-level prompts decoded together with edgeattn::Streams, one step-graph call per token for all.
//
//   streams ARTIFACT_DIR --prompt TEXT [--prompt TEXT ...] [-n 100] [--temperature T[,T...]] [--top-k K] [--top-p P]
//           [--seed S] [--threads N] [--join-every K] [--drop I:STEP] [--separate] [--dump-logits PREFIX]
//           [--state-out PREFIX]
//
// Stream i decodes prompt i with its own sampler: seed S + i and the i-th temperature of the list (cycled; more
// temperatures than prompts are refused), up to
// -n tokens. --join-every K adds prompt i after i*K batch steps (0: all before the first); --drop I:STEP drops
// stream I after batch step STEP (repeatable). --separate decodes each prompt with its own Session instead, one after
// another, with the same samplers: the reference that Streams must equal. The artifact must be exported with
// --dynamic-batch (not needed for --separate) and be byte-level.
//
// stdout: one JSON line, {"mode", "streams": [{"tokens": [...], "dropped": bool}], "steps", "decode_s",
// "tokens_per_s" (all streams together), "us_per_step", "state_bytes_per_stream", "rss_bytes"}; --dump-logits
// writes PREFIX.I.f32, the float32 rows [tokens, vocab] that stream I's tokens were drawn from; --state-out writes
// PREFIX.I.state, the state file of each stream not dropped, after its last token (Streams::save_state). Any error:
// one line on stderr and exit code 1 (2 for bad arguments).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "edgeattn/session.hpp"
#include "example_util.hpp"

namespace {

const char* kUsage =
    "usage: streams ARTIFACT_DIR --prompt TEXT [--prompt TEXT ...] [-n 100] [--temperature T[,T...]] [--top-k K] "
    "[--top-p P] [--seed S] [--threads N] [--join-every K] [--drop I:STEP] [--separate] [--dump-logits PREFIX] "
    "[--state-out PREFIX]";

using example::check_output_file;
using example::one_line;
using example::parse_number;
using example::resident_bytes;
using example::UsageError;

// The options that take a value; any other option is unknown.
const std::set<std::string> kValueOptions = {"--prompt", "-n",        "--temperature", "--top-k",       "--top-p",
                                             "--seed",   "--threads", "--join-every",  "--drop",        "--dump-logits",
                                             "--state-out"};

struct Args {
  std::string artifact, dump_logits, state_out;
  std::vector<std::string> prompts;
  int64_t n = 100;
  std::vector<float> temperatures{0.0f};
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int threads = 0;
  int64_t join_every = 0;
  std::map<int64_t, int64_t> drops;  // stream -> batch step after which it is dropped
  bool separate = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::printf("%s\n", kUsage);
      std::exit(0);
    }
    if (flag == "--separate") {
      a.separate = true;
      continue;
    }
    if (flag.rfind("-", 0) != 0) {
      if (!a.artifact.empty()) throw UsageError("unexpected argument '" + flag + "'");
      a.artifact = flag;
      continue;
    }
    if (!kValueOptions.count(flag)) throw UsageError("unknown option " + flag);
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--prompt") {
      a.prompts.push_back(value);
    } else if (flag == "-n") {
      a.n = parse_number<int64_t>(flag, value);
    } else if (flag == "--temperature") {
      a.temperatures.clear();
      size_t start = 0;
      for (size_t comma; (comma = value.find(',', start)) != std::string::npos; start = comma + 1)
        a.temperatures.push_back(parse_number<float>(flag, value.substr(start, comma - start)));
      a.temperatures.push_back(parse_number<float>(flag, value.substr(start)));
    } else if (flag == "--top-k") {
      a.top_k = parse_number<int>(flag, value);
    } else if (flag == "--top-p") {
      a.top_p = parse_number<float>(flag, value);
    } else if (flag == "--seed") {
      a.seed = parse_number<uint64_t>(flag, value);
    } else if (flag == "--threads") {
      a.threads = parse_number<int>(flag, value);
    } else if (flag == "--join-every") {
      a.join_every = parse_number<int64_t>(flag, value);
    } else if (flag == "--drop") {
      const size_t colon = value.find(':');
      if (colon == std::string::npos) throw UsageError("--drop takes STREAM:STEP, got '" + value + "'");
      a.drops[parse_number<int64_t>(flag, value.substr(0, colon))] = parse_number<int64_t>(flag, value.substr(colon + 1));
    } else if (flag == "--dump-logits") {
      a.dump_logits = value;
    } else if (flag == "--state-out") {
      a.state_out = value;
    } else {
      throw UsageError("unknown option " + flag);
    }
  }
  if (a.artifact.empty()) throw UsageError("missing ARTIFACT_DIR");
  if (a.prompts.empty()) throw UsageError("give at least one --prompt");
  for (const auto& p : a.prompts)
    if (p.empty()) throw UsageError("--prompt must not be empty");
  if (a.temperatures.size() > a.prompts.size())
    throw UsageError("--temperature has " + std::to_string(a.temperatures.size()) + " values for " +
                     std::to_string(a.prompts.size()) + " prompts: give at most one per prompt");
  if (!a.state_out.empty()) check_output_file(a.state_out + ".0.state", "--state-out");
  if (!a.dump_logits.empty()) check_output_file(a.dump_logits + ".0.f32", "--dump-logits");
  if (a.n < 1) throw UsageError("-n must be >= 1");
  if (a.threads < 0 || a.join_every < 0) throw UsageError("--threads and --join-every must be >= 0");
  for (const auto& [stream, step] : a.drops)
    if (stream < 0 || stream >= static_cast<int64_t>(a.prompts.size()) || step < 0)
      throw UsageError("--drop " + std::to_string(stream) + ":" + std::to_string(step) + " names no stream");
  return a;
}

std::vector<int64_t> bytes(const std::string& text) {
  std::vector<int64_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

edgeattn::StreamOptions stream_options(const Args& a, size_t i) {
  edgeattn::StreamOptions o;
  o.sampling = {a.temperatures[i % a.temperatures.size()], a.top_k, a.top_p, a.seed + i};
  o.max_new_tokens = a.n;
  return o;
}

struct Output {
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<float>> logits;  // rows, flattened
  std::vector<bool> dropped;
  int64_t steps = 0;
  int64_t rss_bytes = -1;  // after the last step, the session(s) still open (separate: the largest)
};

// The reference: each prompt through its own Session, as examples/cpp/generate.cpp decodes (EOS stops a stream).
Output run_separate(const Args& a, const edgeattn::SessionOptions& options, double& decode_s) {
  Output out;
  for (size_t i = 0; i < a.prompts.size(); ++i) {
    edgeattn::Session sess(a.artifact, options);
    const edgeattn::StreamOptions o = stream_options(a, i);
    edgeattn::Sampler sampler(o.sampling);
    std::vector<float> logits = sess.prefill(bytes(a.prompts[i]));
    std::vector<int64_t> tokens;
    std::vector<float> rows;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < a.n; ++k) {
      rows.insert(rows.end(), logits.begin(), logits.end());
      const int64_t token = sampler.sample(logits);
      logits = sess.step(token);
      ++out.steps;
      if (sess.manifest().tokenizer.is_eos(token)) break;
      tokens.push_back(token);
    }
    decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.rss_bytes = std::max(out.rss_bytes, resident_bytes());
    out.tokens.push_back(std::move(tokens));
    out.logits.push_back(std::move(rows));
    out.dropped.push_back(false);
  }
  return out;
}

Output run_streams(const Args& a, const edgeattn::SessionOptions& options, double& decode_s, int64_t& state_bytes) {
  edgeattn::Session sess(a.artifact, options);
  edgeattn::Streams streams(sess);
  state_bytes = streams.state_bytes_per_stream();
  const size_t n = a.prompts.size();
  Output out;
  out.tokens.resize(n);
  out.logits.resize(n);
  out.dropped.assign(n, false);
  std::map<int64_t, size_t> index;  // stream id -> prompt index
  size_t joined = 0;
  auto join_due = [&](int64_t step) {
    while (joined < n && static_cast<int64_t>(joined) * a.join_every <= step) {
      index[streams.add(bytes(a.prompts[joined]), stream_options(a, joined))] = joined;
      ++joined;
    }
  };
  join_due(0);
  for (int64_t step = 0; !streams.live().empty() || joined < n; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t id : streams.live()) {
      const auto& logits = streams.logits(id);
      out.logits[index[id]].insert(out.logits[index[id]].end(), logits.begin(), logits.end());
    }
    for (const auto& [id, token] : streams.step()) out.tokens[index[id]].push_back(token);
    decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++out.steps;
    for (const auto& [id, i] : index)
      if (a.drops.count(static_cast<int64_t>(i)) && a.drops.at(static_cast<int64_t>(i)) == step && !out.dropped[i]) {
        streams.drop(id);
        out.dropped[i] = true;
      }
    join_due(step + 1);
  }
  out.rss_bytes = resident_bytes();
  if (!a.state_out.empty())
    for (const auto& [id, i] : index)
      if (!out.dropped[i]) streams.save_state(id, a.state_out + "." + std::to_string(i) + ".state");
  return out;
}

int run(const Args& a) {
  edgeattn::SessionOptions options;
  options.threads = a.threads;
  double decode_s = 0.0;
  int64_t state_bytes = -1;
  const Output out = a.separate ? run_separate(a, options, decode_s) : run_streams(a, options, decode_s, state_bytes);
  int64_t total = 0;
  std::string streams_json;
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    total += static_cast<int64_t>(out.tokens[i].size());
    std::string toks;
    for (size_t k = 0; k < out.tokens[i].size(); ++k) toks += (k ? "," : "") + std::to_string(out.tokens[i][k]);
    streams_json += std::string(i ? ", " : "") + "{\"tokens\": [" + toks + "], \"dropped\": " +
                    (out.dropped[i] ? "true" : "false") + "}";
    if (!a.dump_logits.empty()) {
      const std::string path = a.dump_logits + "." + std::to_string(i) + ".f32";
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(out.logits[i].data()),
              static_cast<std::streamsize>(out.logits[i].size() * sizeof(float)));
      if (!f) throw std::runtime_error("cannot write " + path);
    }
  }
  std::printf(
      "{\"mode\": \"%s\", \"streams\": [%s], \"steps\": %lld, \"decode_s\": %.6f, \"tokens_per_s\": %.2f, "
      "\"us_per_step\": %.3f, \"state_bytes_per_stream\": %lld, \"rss_bytes\": %lld}\n",
      a.separate ? "separate" : "streams", streams_json.c_str(), static_cast<long long>(out.steps), decode_s,
      decode_s > 0 ? total / decode_s : 0.0, out.steps ? 1e6 * decode_s / out.steps : 0.0,
      static_cast<long long>(state_bytes), static_cast<long long>(out.rss_bytes));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "streams: error: %s (see --help)\n", one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streams: error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
