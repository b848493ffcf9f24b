// The chat page of `edgeattn serve`: talks to this server's /v1/chat/completions with streaming, shows the
// conversation and each reply's cached_tokens. Tests read window.edgeattnChat = {turns, busy}.
// `?api_key=KEY` sends a Bearer key; `?max_tokens=N` bounds each reply (default 256); `?temperature=T` sets
// the sampling temperature (0: greedy; default: the server's, as OpenAI's 1).

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const maxTokens = Number(params.get("max_tokens") || 256);
const temperature = params.get("temperature");
const state = { turns: [], busy: false, model: null, error: null };
// One id per page: behind `edgeattn serve --ray` it keeps the conversation on the replica caching it.
const sessionId = `chat-${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
window.edgeattnChat = state;

const $ = (id) => document.getElementById(id);
const headers = () => ({
  "Content-Type": "application/json",
  "x-session-id": sessionId,
  ...(apiKey ? { Authorization: `Bearer ${apiKey}` } : {}),
});

function render() {
  const box = $("messages");
  box.replaceChildren(
    ...state.turns.map((t) => {
      const el = document.createElement("div");
      el.className = `turn ${t.role}`;
      el.textContent = t.content;
      if (t.role === "assistant" && t.cached_tokens !== null) {
        const meta = document.createElement("div");
        meta.className = "meta";
        meta.textContent = `cached_tokens: ${t.cached_tokens}`;
        el.append(meta);
      }
      return el;
    }),
  );
  $("send").disabled = state.busy;
  $("status").textContent = state.error || "";
}

// Server-sent events: "data: ..." lines separated by a blank line.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data) yield data;
    }
  }
}

async function send() {
  const text = $("input").value;
  if (!text || state.busy) return;
  state.busy = true;
  state.error = null;
  $("input").value = "";
  state.turns.push({ role: "user", content: text, cached_tokens: null });
  const messages = state.turns.map(({ role, content }) => ({ role, content }));
  const reply = { role: "assistant", content: "", cached_tokens: null };
  state.turns.push(reply);
  render();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model: state.model,
        messages,
        max_tokens: maxTokens,
        ...(temperature !== null ? { temperature: Number(temperature) } : {}),
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error?.message || `HTTP ${response.status}`);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) reply.content += choice.delta?.content || "";
      if (chunk.usage) reply.cached_tokens = chunk.usage.prompt_tokens_details?.cached_tokens ?? 0;
      render();
    }
  } catch (e) {
    state.error = `error: ${e.message}`;
  } finally {
    state.busy = false;
    render();
  }
}

async function init() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    state.error = `error: /v1/models answered HTTP ${response.status}`;
  } else {
    state.model = (await response.json()).data[0].id;
    $("model").textContent = `model: ${state.model}`;
  }
  $("send").addEventListener("click", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send();
    }
  });
  render();
}

init();
