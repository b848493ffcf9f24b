// edgeattn.json: parse, check and verify (docs/artifact-format.md).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "edgeattn/session.hpp"
#include "state_file.hpp"

namespace edgeattn {
namespace {

using json = nlohmann::json;

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

// A name as the error shows it: quoted, control characters as \xNN (the message stays one line).
std::string quoted(const std::string& name) {
  std::string out = "\"";
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// A name read from the manifest (a files key, a graph's path, ...) is never a path: a plain relative name of a
// file inside the artifact, else ManifestError naming the entry (edgeattn.artifact.manifest.check_name refuses
// the same). No absolute path, no ".." (nor "." or an empty part), no backslash, no colon (a drive letter), no
// NUL.
void check_name(const std::string& where, const std::string& field, const std::string& name) {
  const char* why = nullptr;
  if (name.empty()) {
    why = "is not a file name";
  } else if (name[0] == '/') {
    why = "is an absolute path";
  } else if (name.find('\\') != std::string::npos) {
    why = "holds a backslash";
  } else if (name.find(':') != std::string::npos) {
    why = "holds a colon (a drive letter?)";
  } else if (name.find('\0') != std::string::npos) {
    why = "holds a NUL character";
  } else {
    size_t start = 0;
    while (why == nullptr) {
      const size_t end = name.find('/', start);
      const std::string part = name.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (part.empty() || part == "." || part == "..") why = "has an empty, '.' or '..' part";
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  if (why != nullptr)
    throw ManifestError(where + ": " + field + " " + quoted(name) + " " + why +
                        ": every file an artifact names must be a plain relative name inside it");
}

// ... and resolves inside the artifact: a symbolic link may point within it, never out of it.
void check_inside(const std::string& where, const std::string& dir, const std::string& field,
                  const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path base = fs::weakly_canonical(fs::path(dir.empty() ? "." : dir), ec);
  const fs::path real = ec ? fs::path() : fs::weakly_canonical(fs::path(join_path(dir, name)), ec);
  if (ec) throw ManifestError(where + ": cannot resolve " + field + " " + quoted(name) + ": " + ec.message());
  auto b = base.begin(), r = real.begin();
  for (; b != base.end() && !b->empty(); ++b, ++r)
    if (r == real.end() || *r != *b) break;
  const bool inside = (b == base.end() || b->empty()) && r != real.end() && !r->empty();
  if (!inside)
    throw ManifestError(where + ": " + field + " " + quoted(name) + " leads outside the artifact (a symbolic link to " +
                        real.string() + "): every file an artifact names must be inside it");
}

// Typed field access that names the field in the error.
struct Fields {
  const std::string& where;

  const json& get(const json& obj, const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) throw ManifestError(where + " lacks the key \"" + key + "\"");
    return *it;
  }
  std::string str(const json& obj, const char* key) const {
    const json& v = get(obj, key);
    if (!v.is_string()) throw ManifestError(where + ": \"" + key + "\" must be a string");
    return v.get<std::string>();
  }
  int64_t integer(const json& obj, const char* key) const {
    const json& v = get(obj, key);
    if (!v.is_number_integer()) throw ManifestError(where + ": \"" + key + "\" must be an integer");
    return v.get<int64_t>();
  }
  const json& object(const json& obj, const char* key) const {
    const json& v = get(obj, key);
    if (!v.is_object()) throw ManifestError(where + ": \"" + key + "\" must be an object");
    return v;
  }
};

GraphInfo parse_graph(const Fields& f, const json& graphs, const char* name) {
  const json& g = f.object(graphs, name);
  GraphInfo info{f.str(g, "path"), f.integer(g, "tokens")};
  if (info.tokens < 1) throw ManifestError(f.where + ": graphs." + name + ".tokens must be >= 1");
  return info;
}

// The optional "tokenizer" entry: every special id must be a token of the model's vocabulary.
TokenizerInfo parse_tokenizer(const Fields& f, const json& data, int64_t vocab_size) {
  TokenizerInfo t;
  if (!data.contains("tokenizer") || data["tokenizer"].is_null()) return t;
  const json& tok = f.object(data, "tokenizer");
  if (tok.contains("type")) t.type = f.str(tok, "type");
  if (t.type == "byte") return t;
  if (t.type != "huggingface") throw ManifestError(f.where + ": unknown tokenizer type \"" + t.type + "\"");
  t.path = tok.contains("path") ? f.str(tok, "path") : "tokenizer.json";
  auto check = [&](int64_t id, const std::string& key) {
    if (id < 0 || id >= vocab_size)
      throw ManifestError(f.where + ": tokenizer." + key + " " + std::to_string(id) + " is outside the vocabulary [0, " +
                          std::to_string(vocab_size) + ")");
    return id;
  };
  if (tok.contains("eos_token_ids") && !tok["eos_token_ids"].is_null()) {
    const json& eos = tok["eos_token_ids"];
    if (!eos.is_array()) throw ManifestError(f.where + ": tokenizer.eos_token_ids must be a list");
    for (const json& id : eos) {
      if (!id.is_number_integer()) throw ManifestError(f.where + ": tokenizer.eos_token_ids must hold integers");
      t.eos_token_ids.push_back(check(id.get<int64_t>(), "eos_token_ids"));
    }
  }
  for (auto [key, out] : {std::pair{"bos_token_id", &t.bos_token_id}, std::pair{"pad_token_id", &t.pad_token_id}})
    if (tok.contains(key) && !tok[key].is_null()) *out = check(f.integer(tok, key), key);
  return t;
}

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float64" || dtype == "int64") return 8;
  if (dtype == "float16") return 2;
  if (dtype == "int8" || dtype == "uint8") return 1;
  return 0;
}

// The optional "weights" entry: every tensor's byte length must be its shape times its element size.
WeightsInfo parse_weights(const Fields& f, const json& data) {
  WeightsInfo w;
  if (!data.contains("weights") || data["weights"].is_null()) return w;
  const json& obj = f.object(data, "weights");
  w.path = f.str(obj, "path");
  if (obj.contains("bytes")) w.bytes = f.integer(obj, "bytes");
  const json& tensors = f.get(obj, "tensors");
  if (!tensors.is_array()) throw ManifestError(f.where + ": weights.tensors must be a list");
  for (const json& t : tensors) {
    if (!t.is_object()) throw ManifestError(f.where + ": every weights.tensors entry must be an object");
    WeightTensor e;
    const json& names = f.get(t, "names");
    if (!names.is_array() || names.empty()) throw ManifestError(f.where + ": weights.tensors[].names must be a list");
    for (const json& n : names) {
      if (!n.is_string()) throw ManifestError(f.where + ": weights.tensors[].names must hold strings");
      e.names.push_back(n.get<std::string>());
    }
    e.dtype = f.str(t, "dtype");
    const json& shape = f.get(t, "shape");
    if (!shape.is_array()) throw ManifestError(f.where + ": weights tensor " + e.names[0] + " shape must be a list");
    int64_t n = 1;
    for (const json& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        throw ManifestError(f.where + ": weights tensor " + e.names[0] + " has a bad dimension " + d.dump());
      e.shape.push_back(d.get<int64_t>());
      n *= e.shape.back();
    }
    e.offset = f.integer(t, "offset");
    e.length = f.integer(t, "length");
    // uint4/int4 (an int4 artifact's GatherBlockQuantized data): two to a byte; such artifacts share no weights
    const bool packed = e.dtype == "uint4" || e.dtype == "int4";
    const int64_t item = packed ? 1 : dtype_bytes(e.dtype);
    if (item == 0) throw ManifestError(f.where + ": weights tensor " + e.names[0] + " has unknown dtype " + e.dtype);
    if (e.offset < 0 || e.length != (packed ? (n + 1) / 2 : n * item))
      throw ManifestError(f.where + ": weights tensor " + e.names[0] + " has offset " + std::to_string(e.offset) +
                          " and length " + std::to_string(e.length) + ", which its shape and dtype contradict");
    w.tensors.push_back(std::move(e));
  }
  return w;
}

// An int8 KV buffer's "scale": [Hkv][D] positive numbers for its shape [B, Hkv, max_length, D], flattened.
std::vector<float> parse_kv_scale(const std::string& path, const json& s, const StateEntry& e) {
  const std::vector<int64_t> shape = e.fixed_shape();  // [B, Hkv, max_length, D]
  const std::string want = std::to_string(shape[1]) + " rows of " + std::to_string(shape[3]) +
                           " positive numbers (an int8 KV buffer's scales per KV head and channel)";
  if (!s.contains("scale"))
    throw ManifestError(path + ": state " + e.input + " is an int8 KV buffer without \"scale\": " + want);
  const json& scale = s["scale"];
  std::vector<float> out;
  bool ok = scale.is_array() && static_cast<int64_t>(scale.size()) == shape[1];
  for (size_t r = 0; ok && r < scale.size(); ++r) {
    ok = scale[r].is_array() && static_cast<int64_t>(scale[r].size()) == shape[3];
    for (size_t c = 0; ok && c < scale[r].size(); ++c) {
      const json& x = scale[r][c];
      ok = x.is_number() && x.get<float>() > 0 && std::isfinite(x.get<float>());  // (booleans are not numbers)
      if (ok) out.push_back(x.get<float>());
    }
  }
  if (!ok) throw ManifestError(path + ": state " + e.input + " \"scale\" must list " + want);
  return out;
}

}  // namespace

bool TokenizerInfo::is_eos(int64_t token) const {
  for (int64_t id : eos_token_ids)
    if (id == token) return true;
  return false;
}

bool StateEntry::dynamic() const {
  for (const auto& d : shape)
    if (std::holds_alternative<std::string>(d)) return true;
  return false;
}

std::vector<int64_t> StateEntry::fixed_shape() const {
  std::vector<int64_t> out;
  for (const auto& d : shape) {
    if (std::holds_alternative<std::string>(d))
      throw ManifestError("state " + input + " has the dynamic dimension \"" + std::get<std::string>(d) + "\"");
    out.push_back(std::get<int64_t>(d));
  }
  return out;
}

Manifest Manifest::load(const std::string& dir, bool verify) {
  const std::string path = join_path(dir, "edgeattn.json");
  if (detail::is_special_file(path)) throw ManifestError(path + " is not a regular file (a FIFO or device?)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ManifestError("no manifest at " + path + ": not an exported edgeattn artifact");
  std::stringstream text;
  text << in.rdbuf();
  json data;
  try {
    data = json::parse(text.str());
  } catch (const json::parse_error& e) {
    throw ManifestError(path + " is not valid JSON (byte " + std::to_string(e.byte) + ")");
  }
  if (!data.is_object() || !data.contains("format") || data["format"] != "edgeattn")
    throw ManifestError(path + " is not an edgeattn manifest (\"format\" must be \"edgeattn\")");

  Fields f{path};
  Manifest m;
  m.dir = dir;
  m.format_version = static_cast<int>(f.integer(data, "format_version"));
  if (m.format_version > kFormatVersion)
    throw ManifestError(path + " has format_version " + std::to_string(m.format_version) +
                        "; this edgeattn runtime reads up to " + std::to_string(kFormatVersion) +
                        ": upgrade edgeattn");
  m.fingerprint = f.str(data, "fingerprint");
  m.vocab_size = f.integer(data, "vocab_size");
  m.batch_size = f.integer(data, "batch_size");
  if (m.vocab_size < 1) throw ManifestError(path + ": vocab_size must be >= 1");
  if (data.contains("dynamic_batch") && !data["dynamic_batch"].is_null()) {
    if (!data["dynamic_batch"].is_boolean()) throw ManifestError(path + ": \"dynamic_batch\" must be a boolean");
    m.dynamic_batch = data["dynamic_batch"].get<bool>();
  }
  if (data.contains("target") && data["target"].is_string()) m.target = data["target"];
  if (data.contains("precision") && data["precision"].is_string()) m.precision = data["precision"];
  if (data.contains("max_length") && !data["max_length"].is_null()) m.max_length = f.integer(data, "max_length");
  if (data.contains("inputs") && data["inputs"].contains("input_ids"))
    m.input_ids_name = f.str(data["inputs"], "input_ids");
  if (data.contains("outputs") && data["outputs"].contains("logits"))
    m.logits_name = f.str(data["outputs"], "logits");
  if (data.contains("prefill_logits") && !data["prefill_logits"].is_null()) {
    const std::string mode = f.str(data, "prefill_logits");
    if (mode != "all" && mode != "last")
      throw ManifestError(path + ": \"prefill_logits\" must be \"all\" or \"last\", got \"" + mode + "\"");
    m.last_logits = mode == "last";
  }

  const json& graphs = f.object(data, "graphs");
  m.step = parse_graph(f, graphs, "step");
  if (m.step.tokens != 1) throw ManifestError(path + ": graphs.step.tokens must be 1");
  if (graphs.contains("prefill")) m.prefill = parse_graph(f, graphs, "prefill");

  const json& state = f.get(data, "state");
  if (!state.is_array()) throw ManifestError(path + ": \"state\" must be a list");
  for (const json& s : state) {
    if (!s.is_object()) throw ManifestError(path + ": every \"state\" entry must be an object");
    StateEntry e;
    e.input = f.str(s, "input");
    e.output = f.str(s, "output");
    e.layer = static_cast<int>(f.integer(s, "layer"));
    e.name = f.str(s, "name");
    e.dtype = f.str(s, "dtype");
    const json& shape = f.get(s, "shape");
    if (!shape.is_array()) throw ManifestError(path + ": state " + e.input + " shape must be a list");
    for (const json& d : shape) {
      if (d.is_number_integer() && d.get<int64_t>() >= 0)
        e.shape.emplace_back(d.get<int64_t>());
      else if (d.is_string())
        e.shape.emplace_back(d.get<std::string>());
      else
        throw ManifestError(path + ": state " + e.input + " has a bad dimension " + d.dump());
    }
    if (s.contains("shared") && !s["shared"].is_null()) {
      if (!s["shared"].is_boolean()) throw ManifestError(path + ": state " + e.input + " \"shared\" must be a boolean");
      e.shared = s["shared"].get<bool>();
      if (e.shared && e.dynamic())
        throw ManifestError(path + ": state " + e.input + " is shared between past and present but has a dynamic "
                                   "dimension: a shared KV buffer has a fixed size (max_length)");
    }
    if (e.shared && m.max_length < 0)
      throw ManifestError(path + ": state " + e.input + " is a shared KV buffer, but \"max_length\" is not set");
    if (e.dtype != "float32" && !(e.shared && (e.dtype == "float16" || e.dtype == "int8")))
      throw ManifestError(path + ": state " + e.input + " has dtype " + e.dtype +
                          ": state tensors are float32 (a shared KV buffer float16 or int8 too)");
    if (e.dtype != "float32" && e.fixed_shape().size() != 4)
      throw ManifestError(path + ": state " + e.input + " is a " + e.dtype + " KV buffer of " +
                          std::to_string(e.shape.size()) + " dimensions, not [B, H, max_length, D]");
    if (e.dtype == "int8") e.scale = parse_kv_scale(path, s, e);
    m.state.push_back(std::move(e));
  }

  m.tokenizer = parse_tokenizer(f, data, m.vocab_size);
  m.weights = parse_weights(f, data);

  const json& files = f.object(data, "files");
  for (auto it = files.begin(); it != files.end(); ++it) {
    if (!it.value().is_object()) throw ManifestError(path + ": files." + it.key() + " must be an object");
    m.files.emplace_back(it.key(), Fields{path}.str(it.value(), "sha256"));
  }
  // A graph or weights file that is not listed under "files" could not be verified: refuse it rather than run it
  // unchecked.
  std::vector<std::string> must_list;
  for (const GraphInfo* g : {&m.step, &m.prefill})
    if (g->tokens > 0) must_list.push_back(g->path);
  if (!m.weights.path.empty()) must_list.push_back(m.weights.path);
  for (const std::string& name : must_list) {
    bool listed = false;
    for (const auto& file : m.files) listed = listed || file.first == name;
    if (!listed) throw ManifestError(path + ": " + name + " is not listed under \"files\", so it cannot be verified");
  }

  // every name the manifest holds: plain, relative, inside the artifact
  std::vector<std::pair<std::string, std::string>> names;
  for (const auto& file : m.files) names.emplace_back("'files' entry", file.first);
  names.emplace_back("'graphs.step.path'", m.step.path);
  if (m.prefill.tokens > 0) names.emplace_back("'graphs.prefill.path'", m.prefill.path);
  if (!m.weights.path.empty()) names.emplace_back("'weights.path'", m.weights.path);
  if (!m.tokenizer.path.empty()) names.emplace_back("'tokenizer.path'", m.tokenizer.path);
  for (const char* section : {"genai", "tokenizer"})
    if (data.contains(section) && data[section].is_object())
      for (const char* key : {"graph", "config", "chat_template"})
        if (data[section].contains(key) && data[section][key].is_string())
          names.emplace_back(std::string("'") + section + "." + key + "'", data[section][key].get<std::string>());
  if (data.contains("checkpoint") && data["checkpoint"].is_string() && !data["checkpoint"].get<std::string>().empty())
    names.emplace_back("'checkpoint'", data["checkpoint"].get<std::string>());
  for (const auto& [field, name] : names) check_name(path, field, name);
  for (const auto& [field, name] : names) check_inside(path, dir, field, name);

  if (verify) {
    for (const auto& [name, expected] : m.files) {
      const std::string file = join_path(dir, name);
      if (sha256_hex(file) != expected)
        throw IntegrityError(file + " does not match its sha256 in edgeattn.json: the file is corrupt or was edited");
    }
  }
  return m;
}

}  // namespace edgeattn
