// Brass web chat: plain JS against the server's OpenAI-compatible API, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];          // the conversation as OpenAI messages
let modelId = null;
let controller = null;       // aborts the reply in flight (the server then stops generating)

const apiKey = $("api-key");
apiKey.value = localStorage.getItem("brass-api-key") || "";
apiKey.addEventListener("change", () => { localStorage.setItem("brass-api-key", apiKey.value); loadModel(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey.value) h["Authorization"] = "Bearer " + apiKey.value;
  return h;
}

async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return response.status + " " + response.statusText; }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await errorText(r));
    modelId = (await r.json()).data[0].id;
    $("model").textContent = modelId;
  } catch (e) {
    $("model").textContent = "not connected: " + e.message;
  }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
}

// Server-sent events arrive in arbitrary slices: split on blank lines, keep the unfinished rest.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function showRate(tokens, firstAt, now) {
  const seconds = (now - firstAt) / 1000;
  // The first token's time is the prompt's; the rate counts the tokens after it.
  const rate = seconds > 0 && tokens > 1 ? ((tokens - 1) / seconds).toFixed(1) : "–";
  $("stats").textContent = `${tokens} tokens · ${rate} tok/s`;
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  const messages = ($("system").value.trim() ? [{ role: "system", content: $("system").value }] : []).concat(history);
  const request = {
    model: modelId || undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  controller = new AbortController();
  busy(true);
  $("stats").textContent = "waiting…";
  const started = performance.now();
  let firstAt = null, chunks = 0, reply = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(request), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const event of sseEvents(r.body)) {
      if (event.error) throw new Error(event.error.message);
      const piece = event.choices.length ? event.choices[0].delta.content : null;
      if (piece) {
        if (firstAt === null) firstAt = performance.now();
        chunks += 1;
        reply += piece;
        out.textContent = reply;
        out.scrollIntoView({ block: "end" });
        showRate(chunks, firstAt, performance.now());
      }
      if (event.usage) showRate(event.usage.completion_tokens, firstAt ?? started, performance.now());
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      out.className = "msg error";
      out.textContent = (reply ? reply + "\n\n" : "") + "Error: " + e.message;
    }
  } finally {
    // A stopped reply stays in the conversation as far as it got, as in `brass chat`.
    if (reply) history.push({ role: "assistant", content: reply });
    else {
      history.pop();  // nothing came back: a retry should not send this message twice
      if (out.className === "msg assistant") out.remove();
    }
    controller = null;
    busy(false);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value;
  if (!text.trim() || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
  $("stats").textContent = "";
});

loadModel();
