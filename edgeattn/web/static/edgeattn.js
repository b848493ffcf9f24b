// edgeattn in the browser: runs an exported artifact (model/edgeattn.json) with onnxruntime-web, keeping the
// recurrent state in JavaScript between calls exactly as edgeattn's Python Session does (the manifest's
// past/present names, full prefill chunks then single steps, or one call for the rest on a one-graph
// artifact). Tests and benchmarks read window.edgeattn: tokens (ids), done, error, text, ttft_ms,
// tokens_per_s, state_bytes, wasmBytes(). URL query: ?prompt=TEXT&max_new_tokens=N&temperature=T
// &top_p=P&top_k=K&seed=S&threads=N&ep=auto|wasm|webgpu&chat=1&autostart=1 (temperature 0 is greedy; chat=1
// formats the prompt as one user message with the model's chat template, as `edgeattn run --chat`: the
// text before and after the message, rendered by `edgeattn web` into site.json's "chat").

// Every WebAssembly.Memory the runtime creates, so that the page can report the WASM heap's size.
const memories = [];
WebAssembly.Memory = new Proxy(WebAssembly.Memory, {
  construct(target, args, newTarget) {
    const memory = Reflect.construct(target, args, newTarget);
    memories.push(memory);
    return memory;
  },
});

const base = new URL("./", import.meta.url);
const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);

const api = {
  ready: false, // the model is loaded
  busy: false,
  done: false, // the last generation has ended (or failed: see error)
  error: null,
  tokens: [], // the generated token ids
  text: "",
  ep: null,
  threads: null,
  prefill_ms: null,
  ttft_ms: null, // from the start of prefill to the first generated token
  decode_ms: null,
  tokens_per_s: null, // generated tokens after the first / the time of their steps
  state_bytes: 0,
  prefillLogits: null,
  position: 0, // tokens in the state
  wasmBytes: () => memories.reduce((n, m) => n + m.buffer.byteLength, 0),
  generate,
  // the pieces the page shows for token ids, as they arrive (tests check UTF-8 across token boundaries)
  decodePieces: (ids) => {
    const d = tokenizer.decoder();
    return [...ids.map((id) => d.push(id)), d.end()].filter((p) => p !== "");
  },
};
window.edgeattn = api;

let ort, manifest, tokenizer, sessions, state;
let chatWrap = null; // {prefix, suffix}: site.json's chat template around one user message, or null

function num(name, fallback) {
  const v = params.get(name);
  return v === null || v === "" ? fallback : Number(v);
}

function setStatus(text) {
  $("status").textContent = text;
}

async function fetchBytes(path) {
  const r = await fetch(new URL(path, base));
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

async function chooseEp() {
  const asked = params.get("ep") || "auto";
  if (asked !== "auto") return asked;
  if (!navigator.gpu) return "wasm";
  try {
    return (await navigator.gpu.requestAdapter()) ? "webgpu" : "wasm";
  } catch {
    return "wasm";
  }
}

// ---- tokenizers: byte-level (UTF-8 bytes are the ids) or a tokenizer.json ----

class ByteTokenizer {
  eos = [];
  encode(text) {
    return Array.from(new TextEncoder().encode(text));
  }
  decoder() {
    // UTF-8 across token boundaries: a character's bytes may arrive in several tokens
    const d = new TextDecoder("utf-8");
    return { push: (id) => d.decode(new Uint8Array([id]), { stream: true }), end: () => d.decode() };
  }
}

class HFTokenizer {
  constructor(tok, info) {
    this.tok = tok;
    this.eos = (info.eos_token_ids || []).map(Number);
  }
  encode(text) {
    return this.tok.encode(text, { add_special_tokens: true }).ids.map(Number);
  }
  decoder() {
    // decode the growing sequence; a trailing U+FFFD (an incomplete byte sequence) waits for more
    // (the last piece is shown whatever its end, as edgeattn.artifact.tokenizer.HFTokenizer.stream)
    const ids = [];
    let done = "";
    const next = (final) => {
      const text = this.tok.decode(ids, { skip_special_tokens: false });
      if ((!final && text.endsWith("\ufffd")) || !text.startsWith(done) || text.length <= done.length) return "";
      const piece = text.slice(done.length);
      done = text;
      return piece;
    };
    return { push: (id) => (ids.push(id), next(false)), end: () => next(true) };
  }
}

async function loadTokenizer() {
  const info = manifest.tokenizer;
  if (!info || (info.type || "byte") === "byte") return new ByteTokenizer();
  const { Tokenizer } = await import(new URL("tokenizers/tokenizers.min.mjs", base).href);
  const json = JSON.parse(new TextDecoder().decode(await fetchBytes(`model/${info.path || "tokenizer.json"}`)));
  return new HFTokenizer(new Tokenizer(json, {}), info);
}

// ---- the model: sessions and state, as edgeattn.runtimes.onnxruntime ----

async function load() {
  const t0 = performance.now();
  manifest = JSON.parse(new TextDecoder().decode(await fetchBytes("model/edgeattn.json")));
  chatWrap = JSON.parse(new TextDecoder().decode(await fetchBytes("site.json"))).chat ?? null;
  api.ep = await chooseEp();
  const file = api.ep === "webgpu" ? "ort.webgpu.min.mjs" : "ort.wasm.min.mjs";
  ort = await import(new URL(`ort/${file}`, base).href);
  ort.env.wasm.wasmPaths = new URL("ort/", base).href;
  const threads = num("threads", self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1);
  ort.env.wasm.numThreads = threads;
  api.threads = threads;
  setStatus(`loading the model (${api.ep}, ${threads} thread${threads > 1 ? "s" : ""})...`);
  // one copy of the shared weights file, handed to each session as its external data
  const external = manifest.weights
    ? [{ path: manifest.weights.path, data: await fetchBytes(`model/${manifest.weights.path}`) }]
    : [];
  const options = { executionProviders: [api.ep], externalData: external, graphOptimizationLevel: "all" };
  const loaded = new Map(); // a graph file that serves as step and prefill is loaded once
  sessions = {};
  for (const g of ["step", "prefill"]) {
    const path = manifest.graphs[g].path;
    if (!loaded.has(path)) loaded.set(path, await ort.InferenceSession.create(await fetchBytes(`model/${path}`), options));
    sessions[g] = loaded.get(path);
  }
  tokenizer = await loadTokenizer();
  reset();
  api.ready = true;
  setStatus(`ready: ${manifest.target || "?"} ${manifest.precision || "fp32"}, ${api.ep}, ${threads} thread(s), loaded in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
}

// The element types a state tensor may have (a KV buffer of an --kv-dtype float16 or int8 export; every
// other state tensor is float32): onnxruntime-web holds float16 as its bits in a Uint16Array.
const STATE_ARRAYS = { float32: Float32Array, float16: Uint16Array, int8: Int8Array };

function reset() {
  // the initial state is all zeros (an int8 KV buffer's zero is 0 too: its scales are in the graph); a
  // dynamic dimension (a growing KV cache) starts at 0
  state = manifest.state.map((e) => {
    const dims = e.shape.map((d) => (typeof d === "string" ? 0 : d));
    const Array_ = STATE_ARRAYS[e.dtype || "float32"];
    if (!Array_) throw new Error(`state ${e.input} has the element type ${e.dtype}, which this page does not know`);
    return new ort.Tensor(e.dtype || "float32", new Array_(dims.reduce((a, b) => a * b, 1)), dims);
  });
  api.position = 0;
}

function stateBytes() {
  return state.reduce((n, t) => n + t.data.byteLength, 0);
}

// Run graph "step" or "prefill" on ids (numbers), advancing the state; the logits of the last position.
async function run(graph, ids) {
  const V = manifest.vocab_size;
  const feeds = {};
  feeds[manifest.inputs?.input_ids || "input_ids"] = new ort.Tensor("int64", BigInt64Array.from(ids, BigInt), [1, ids.length]);
  manifest.state.forEach((e, i) => (feeds[e.input] = state[i]));
  const out = await sessions[graph].run(feeds);
  // present -> past; a shared KV buffer comes back whole with the new tokens written into it
  state = manifest.state.map((e) => out[e.output]);
  api.position += ids.length;
  // [1, T, V], or [1, 1, V] from an artifact exported with --prefill-logits last: the last row either way
  const logits = out[manifest.outputs?.logits || "logits"];
  const rows = logits.dims[1];
  if (logits.data.length !== rows * V) throw new Error(`${graph}: logits of shape [${logits.dims}], not [1, T, ${V}]`);
  return logits.data.slice((rows - 1) * V, rows * V);
}

async function prefill(ids) {
  if (ids.length === 0) throw new Error("the prompt is empty");
  const C = manifest.graphs.prefill.tokens;
  const dynamic = manifest.state.some((e) => e.shape.some((d) => typeof d === "string"));
  // one graph for any number of tokens (a dynamic token axis): the rest in one call, as the Python session
  const anyTokens = manifest.graphs.step.path === manifest.graphs.prefill.path && !dynamic;
  let logits;
  let t = 0;
  for (; t + C <= ids.length; t += C) logits = await run("prefill", ids.slice(t, t + C));
  if (t < ids.length && anyTokens) return run("prefill", ids.slice(t));
  for (; t < ids.length; t++) logits = await run("step", [ids[t]]);
  return logits;
}

// ---- sampling, as edgeattn.runtimes.sampling.sample_next ----

function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function argmax(x) {
  let best = 0;
  for (let i = 1; i < x.length; i++) if (x[i] > x[best]) best = i;
  return best;
}

function sampleNext(logits, { temperature, top_k, top_p }, random) {
  if (!(temperature > 0)) return argmax(logits);
  const z = Array.from(logits, (v) => v / temperature);
  if (!z.every(Number.isFinite)) return argmax(logits);
  let order = z.map((_, i) => i).sort((a, b) => z[b] - z[a]);
  if (top_k > 0 && top_k < z.length) order = order.slice(0, top_k);
  const m = z[order[0]];
  let p = order.map((i) => Math.exp(z[i] - m));
  let sum = p.reduce((a, b) => a + b, 0);
  p = p.map((v) => v / sum);
  if (top_p < 1) {
    let acc = 0;
    let keep = 0;
    while (keep < p.length && acc < top_p) acc += p[keep++]; // always keeps the most likely token
    order = order.slice(0, keep);
    p = p.slice(0, keep);
    sum = p.reduce((a, b) => a + b, 0);
    p = p.map((v) => v / sum);
  }
  let r = random();
  for (let i = 0; i < p.length; i++) if ((r -= p[i]) < 0) return order[i];
  return order[order.length - 1];
}

// ---- generation ----

// Yield to the event loop so that the page paints and answers: a message to itself, not setTimeout (which a
// hidden tab throttles to once a second) nor scheduler.yield (whose continuation starves other tasks).
const nextFrame = () =>
  new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => resolve();
    channel.port2.postMessage(0);
  });

async function generate({ prompt, max_new_tokens = 64, temperature = 0, top_k = 0, top_p = 1, seed = null, chat = false } = {}) {
  if (api.busy) throw new Error("a generation is running");
  $("run").disabled = true;
  Object.assign(api, { busy: true, done: false, error: null, tokens: [], text: "", ttft_ms: null, tokens_per_s: null });
  $("prompt-echo").textContent = prompt;
  $("generated").textContent = "";
  try {
    if (chat && !chatWrap) throw new Error("this model has no chat template");
    const ids = tokenizer.encode(chat ? chatWrap.prefix + prompt + chatWrap.suffix : prompt);
    const limit = manifest.max_length;
    if (limit && ids.length + max_new_tokens > limit) {
      throw new Error(`${ids.length} prompt tokens + ${max_new_tokens} new tokens exceed this artifact's maximum of ${limit}`);
    }
    const random = seed === null ? Math.random : mulberry32(seed);
    const opts = { temperature, top_k, top_p };
    const stop = new Set(tokenizer.eos);
    const decoder = tokenizer.decoder();
    reset();
    const t0 = performance.now();
    let logits = await prefill(ids);
    api.prefillLogits = logits; // the next-token logits after the prompt (tests compare them)
    api.prefill_ms = performance.now() - t0;
    let tFirst = null;
    let lastPaint = performance.now();
    for (let n = 0; n < max_new_tokens; n++) {
      const next = sampleNext(logits, opts, random);
      if (tFirst === null) {
        tFirst = performance.now();
        api.ttft_ms = tFirst - t0;
      }
      if (stop.has(next)) {
        logits = await run("step", [next]); // consumed into the state, not shown (as Session.generate_ids)
        break;
      }
      api.tokens.push(next);
      api.text += decoder.push(next);
      logits = await run("step", [next]);
      const now = performance.now();
      if (now - lastPaint > 100) {
        show(now - tFirst);
        await nextFrame(); // let the page paint the growing text
        lastPaint = performance.now();
      }
    }
    api.text += decoder.end();
    const end = performance.now();
    api.decode_ms = tFirst === null ? 0 : end - tFirst;
    show(api.decode_ms);
  } catch (e) {
    api.error = String(e?.message ?? e);
    setStatus(`error: ${api.error}`);
  } finally {
    api.busy = false;
    api.done = true;
    $("run").disabled = false;
  }
  return api.tokens;
}

function show(elapsedMs) {
  api.state_bytes = stateBytes();
  const steps = api.tokens.length - 1;
  api.tokens_per_s = steps > 0 && elapsedMs > 0 ? (steps * 1000) / elapsedMs : null;
  $("generated").textContent = api.text;
  $("stats").textContent =
    `${api.tokens.length} tokens` +
    (api.tokens_per_s ? `, ${api.tokens_per_s.toFixed(1)} tokens/s` : "") +
    (api.ttft_ms !== null ? `, first token after ${api.ttft_ms.toFixed(0)} ms` : "") +
    `, state ${api.state_bytes.toLocaleString("en")} bytes`;
}

function formOptions() {
  const seed = $("seed").value.trim();
  return {
    prompt: $("prompt").value,
    max_new_tokens: Number($("max_new_tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    top_k: Number($("top_k").value),
    seed: seed === "" ? null : Number(seed),
    chat: $("chat").checked,
  };
}

async function main() {
  if (location.protocol === "file:") {
    // index.html has said that the page must be served over HTTP (a browser that runs this module from
    // file:// still cannot fetch the model): keep its message
    Object.assign(api, { done: true, error: $("status").textContent.replace(/^error: /, "") });
    return;
  }
  for (const name of ["prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed"]) {
    if (params.has(name)) $(name).value = params.get(name);
  }
  $("chat").checked = params.get("chat") === "1";
  $("run").addEventListener("click", () => generate(formOptions()));
  try {
    await load();
  } catch (e) {
    api.error = String(e?.message ?? e);
    api.done = true;
    setStatus(`error: ${api.error}`);
    return;
  }
  $("run").disabled = false;
  $("chat").disabled = !chatWrap;
  if (params.get("autostart") === "1") await generate(formOptions());
}

main();
