// The page at `/`: a chat box that streams from /v1/chat/completions, and the pipeline as
// /v1/status and /metrics show it, polled. No framework: every piece of text that came from
// the model, a user or the server goes into the DOM as a text node (el() below), never as HTML.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "strata-api-key";   // sessionStorage: the key lives as long as the tab

const $ = (id) => document.getElementById(id);
const conversation = [];             // [{role, content}], sent with each question
let generating = null;               // the AbortController of the answer streaming now
let lastTokens = null;               // [generated tokens, ms] at the previous /metrics read

// el("td", {className: "x"}, "text", child, ...): strings become text nodes
function el(tag, props, ...children) {
  const node = Object.assign(document.createElement(tag), props || {});
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// cells: text, or [text, class] for a cell of its own style
function row(cells, className) {
  return el("tr", className ? {className} : null, ...cells.map((c) => Array.isArray(c)
    ? el("td", {className: c[1]}, c[0]) : el("td", null, c)));
}

function fill(tableId, rows) {
  $(tableId).tBodies[0].replaceChildren(...rows);
}

function headers() {
  const key = $("key").value.trim();
  const h = {"Content-Type": "application/json"};
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// a 401 from any /v1 route: ask for the key (the focus moves once, not at every poll)
function needKey(missing) {
  if (missing && $("auth-notice").hidden) $("key").focus();
  $("auth-notice").hidden = !missing;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

// --- the chat ------------------------------------------------------------------------------

function addMessage(role, text) {
  const body = el("span", {className: "text"}, text);
  const node = el("div", {className: "message " + role}, body);
  $("messages").append(node);
  $("messages").scrollTop = $("messages").scrollHeight;
  return node;
}

function setMeta(node, text) {
  let meta = node.querySelector(".meta");
  if (!meta) node.append(meta = el("span", {className: "meta"}));
  meta.textContent = text;
}

// server-sent events: yields each `data:` payload of the response body
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), {stream: !done});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
    if (done) return;
  }
}

async function send(text) {
  conversation.push({role: "user", content: text});
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const out = answer.querySelector(".text");
  answer.dataset.state = "streaming";
  answer.dataset.chunks = "0";
  const body = {messages: conversation, stream: true, stream_options: {include_usage: true},
                max_tokens: Number($("max-tokens").value),
                temperature: Number($("temperature").value)};
  generating = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let failure = null, usage = null, finish = null;
  try {
    const response = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: generating.signal});
    if (!response.ok) {
      needKey(response.status === 401);
      throw new Error(await errorText(response));
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      if (choice.delta && choice.delta.content) {
        out.append(choice.delta.content);   // a text node: the model's text stays text
        answer.dataset.chunks = String(Number(answer.dataset.chunks) + 1);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (e) {
    failure = e.name === "AbortError" ? "stopped" : e.message;
  } finally {
    generating = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  out.normalize();
  const seconds = (performance.now() - started) / 1000;
  if (failure === "stopped" && out.textContent) {   // the answer so far stays in the talk
    conversation.push({role: "assistant", content: out.textContent});
    setMeta(answer, "stopped");
    answer.dataset.state = "stopped";
    return;
  }
  if (failure) {
    conversation.pop();   // the turn did not happen: the next request leaves it out
    answer.classList.add("error");
    setMeta(answer, failure);
    answer.dataset.state = "failed";
    return;
  }
  conversation.push({role: "assistant", content: out.textContent});
  const tokens = usage ? usage.completion_tokens : null;
  setMeta(answer, (tokens === null ? "" : `${tokens} tokens, `) +
                  `${seconds.toFixed(1)} s, finished: ${finish}`);
  answer.dataset.state = "done";
}

function setupChat() {
  $("send-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || generating) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("send-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => generating && generating.abort());
  $("clear").addEventListener("click", () => {
    if (generating) generating.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
  });
}

// --- the pipeline --------------------------------------------------------------------------

// Prometheus text -> [{name, labels, value}]
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m || line.startsWith("#")) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    samples.push({name: m[1], labels, value: Number(m[3])});
  }
  return samples;
}

function metric(samples, name, labels) {
  let sum = 0;
  for (const s of samples) {
    if (s.name === name && Object.entries(labels || {}).every(([k, v]) => s.labels[k] === v)) {
      sum += s.value;
    }
  }
  return sum;
}

// a histogram's mean in ms, and how many it counted
function meanMs(samples, name, labels, counted = true) {
  const count = metric(samples, name + "_count", labels);
  if (!count) return "–";
  const ms = (metric(samples, name + "_sum", labels) / count * 1000).toFixed(1);
  return counted ? `${ms} ms (${count})` : `${ms} ms`;
}

function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function kept(d) {
  if (!d || !d.proposed) return "–";
  return `${d.accepted} / ${d.proposed}`;
}

function renderStatus(s, samples) {
  $("model").textContent = `${s.model}: batch ${s.batch} in ${s.batch_groups} groups, ` +
    `${s.ctx} positions, ${s.queued} queued`;
  $("health").textContent = s.healthy ? "healthy" : `unhealthy: ${s.error}`;
  $("health").className = s.healthy ? "ok" : "bad";
  fill("stages", s.stages.map((st) => row([
    st.stage, `[${st.layers[0]}, ${st.layers[1]})`, st.device, st.pid, st.restarts,
    [st.weights || "–", "small"],
    st.memory ? `weights ${bytes(st.memory.weights)}, KV ${bytes(st.memory.kv_cache)}` : "–",
    meanMs(samples, "strata_stage_window_seconds", {stage: String(st.stage), kind: "decode"}),
    meanMs(samples, "strata_stage_window_seconds", {stage: String(st.stage), kind: "prefill"}),
  ])));
  fill("slots", s.slots.map((sl) => sl.state === "idle"
    ? row([sl.slot, sl.group, "idle", "–", `${sl.cached_tokens} cached`, "–", "–", "–"])
    : row([sl.slot, sl.group, sl.state, sl.request || "–",
           `${sl.read} / ${sl.prompt_tokens} read` + (sl.reused ? `, ${sl.reused} reused` : ""),
           sl.generated, sl.tok_s === null ? "–" : sl.tok_s, kept(sl.drafts)], "busy")));
  fill("groups", s.groups.map((g) => {
    const flying = g.windows_in_flight !== undefined ? g.windows_in_flight
                                                     : Number(g.window_in_flight);
    const w = g.decode_window;
    const d = g.drafts;
    return row([g.group, g.slots.join(", "), flying,
                w ? `${w.live} live of ${w.rows} rows` : "–",
                d ? `${d.k} (acceptance ${d.acceptance})` : "–"], flying ? "busy" : "");
  }));
  if (s.draft_tokens) {
    const d = s.drafts;
    const at = (d.positions || []).map((p) => `${p.position}: ${kept(p)}`).join(", ");
    $("drafts").textContent = `${s.drafter}, up to ${s.draft_tokens} per slot` +
      (s.draft_sampling ? ` (${s.draft_sampling})` : "") +
      `: ${d.accepted} kept of ${d.proposed} proposed` +
      (d.rate === null ? "" : ` (${(d.rate * 100).toFixed(1)}%)`) +
      (at ? `; by position ${at}` : "");
  } else {
    $("drafts").textContent = "no drafts (strata-launch --draft-tokens 0)";
  }
  const generated = metric(samples, "strata_generated_tokens_total");
  const now = performance.now();
  let rate = "";
  if (lastTokens && now > lastTokens[1]) {
    rate = `, ${((generated - lastTokens[0]) / (now - lastTokens[1]) * 1000).toFixed(1)} ` +
           "tok/s now";
  }
  lastTokens = [generated, now];
  const finished = ["stop", "length", "cancelled", "error"]
    .map((r) => `${metric(samples, "strata_finished_requests_total", {reason: r})} ${r}`)
    .join(", ");
  $("totals").textContent = `${s.windows} windows; ${generated} tokens generated${rate}; ` +
    `requests finished: ${finished}; time to first token ` +
    meanMs(samples, "strata_time_to_first_token_seconds", {}, false);
}

async function poll() {
  try {
    const status = await fetch("v1/status", {headers: headers()});
    needKey(status.status === 401);
    if (status.status === 401) {
      $("health").textContent = "";
      return;
    }
    if (!status.ok) {
      $("health").textContent = await errorText(status);
      $("health").className = "bad";
      return;
    }
    const metrics = await fetch("metrics", {headers: headers()});
    const samples = metrics.ok ? parseMetrics(await metrics.text()) : [];
    renderStatus(await status.json(), samples);
  } catch (e) {
    $("health").textContent = `the server does not answer (${e.message})`;
    $("health").className = "bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function setupKey() {
  $("key").value = sessionStorage.getItem(KEY_ITEM) || "";
  $("key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_ITEM, $("key").value.trim());
  });
}

setupKey();
setupChat();
poll();
