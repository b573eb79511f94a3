// orchestra web view: plain JS over the server's JSON routes and the runs' Server-Sent Events.
// Every API call carries the key (if any) as a Bearer header; the events are read with fetch() streaming,
// since EventSource cannot send headers. Text from the server is always set as textContent, never as HTML.
"use strict";

const BASE = location.pathname.replace(/\/ui(\/.*)?$/, "");  // the app may be mounted under a prefix
const KEY_STORE = "orchestra.apiKey";
const STATES = ["waiting", "running", "succeeded", "failed", "skipped"];
const PATHS = ["exact", "mapped", "reprefilled"];
const SVG_NS = "http://www.w3.org/2000/svg";
const DOC_NODE = "__document";

const app = { config: null, pipelines: [], runs: [], run: null, stream: null, selectedNode: null,
              blocked: false, drawn: "", pending: false, timers: [], startedWith: new Map() };

// -- small helpers ---------------------------------------------------------------------------------------------------
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

// A label that fits a node's box: a folder's last part, long names cut (the tooltip has them whole).
function short(text, max = 22) {
  const base = String(text).includes("/") ? String(text).split("/").filter(Boolean).pop() || String(text) : String(text);
  return base.length > max ? `${base.slice(0, max - 1)}…` : base;
}

function secs(value) { return value === null || value === undefined ? "–" : `${Number(value).toFixed(2)} s`; }
function bytes(n) { return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`; }

function banner(text, bad) {
  const node = $("banner");
  node.hidden = !text;
  node.textContent = text || "";
  node.classList.toggle("bad", !!bad);
}

// -- the API ---------------------------------------------------------------------------------------------------------
class ApiError extends Error {}

function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  const headers = Object.assign({}, opts.headers || {});
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  opts.headers = headers;
  const res = await fetch(BASE + path, opts);
  if (res.status === 401) {
    app.blocked = true;
    banner(key ? "The server refused this API key: enter the right one above." :
      "This server needs an API key: enter it above (it is kept in this browser only).", true);
    throw new ApiError("unauthorized");
  }
  return res;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || body.detail || `HTTP ${res.status}`;
  } catch (_) {
    return `HTTP ${res.status}`;
  }
}

async function getJSON(path) {
  const res = await api(path);
  if (!res.ok) throw new ApiError(await errorText(res));
  return res.json();
}

// Every background call goes through here: a failure is shown on the page, never left as an unhandled rejection.
function quietly(promise) {
  promise.catch((err) => { if (!(err instanceof ApiError && err.message === "unauthorized")) banner(String(err.message || err), true); });
}

// -- pipelines and the start form ------------------------------------------------------------------------------------
async function loadPipelines() {
  const list = await getJSON("/v1/pipelines");
  app.pipelines = list.data;
  const select = $("pipeline");
  const current = select.value;
  select.replaceChildren(...app.pipelines.map((p) => el("option", { value: p.name, disabled: !!p.error },
    p.error ? `${p.name} (cannot run)` : p.name)));
  if (current && app.pipelines.some((p) => p.name === current)) select.value = current;
  $("start").disabled = !app.pipelines.some((p) => !p.error);
  $("pipeline-note").textContent = app.pipelines.length ? "" :
    "This server has no pipelines folder: start it with --pipelines DIR.";
  showInputs();
}

function showInputs() {
  const pipe = app.pipelines.find((p) => p.name === $("pipeline").value);
  const box = $("inputs");
  box.replaceChildren();
  if (!pipe) return;
  if (pipe.error) $("pipeline-note").textContent = pipe.error;
  for (const input of pipe.inputs) {
    const field = el("input", { type: "text", value: input.default || "", placeholder: input.description || "" });
    field.dataset.input = input.name;
    box.append(el("label", {}, input.name), field);
  }
}

async function startRun(event) {
  event.preventDefault();
  const error = $("start-error");
  error.hidden = true;
  const inputs = {};
  for (const field of $("inputs").querySelectorAll("input[data-input]")) inputs[field.dataset.input] = field.value;
  const body = { pipeline: $("pipeline").value, document: $("document").value, inputs };
  if (!body.document.trim()) { error.textContent = "Paste the document's text first."; error.hidden = false; return; }
  $("start").disabled = true;
  try {
    const res = await api("/v1/runs", { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify(body) });
    if (!res.ok) throw new ApiError(await errorText(res));
    const run = await res.json();
    app.startedWith.set(run.id, body.pipeline);
    await loadRuns();
    selectRun(run.id);
  } catch (err) {
    if (!(err instanceof ApiError && err.message === "unauthorized")) {
      error.textContent = String(err.message || err);
      error.hidden = false;
    }
  } finally {
    $("start").disabled = false;
  }
}

function readFile() {
  const file = $("document-file").files[0];
  if (file) quietly(file.text().then((text) => { $("document").value = text; }));
}

// -- the runs list ---------------------------------------------------------------------------------------------------
async function loadRuns() {
  const list = await getJSON("/v1/ui/runs");
  app.runs = list.data;
  $("runs-empty").hidden = app.runs.length > 0;
  $("runs").replaceChildren(...app.runs.map((r) => {
    const item = el("li", { "data-run": r.id, "data-status": r.status, title: new Date(r.created * 1000).toLocaleString() },
      el("span", { class: "id" }, r.id.slice(0, 8)), el("span", { class: "pipe" }, r.pipeline),
      el("span", { class: `badge ${r.status}` }, r.status));
    if (app.run && app.run.id === r.id) item.classList.add("selected");
    item.addEventListener("click", () => selectRun(r.id));
    return item;
  }));
  if (!app.run && app.runs.length) selectRun(app.runs[0].id);
}

// -- one run's state, from its events --------------------------------------------------------------------------------
function newRun(id) {
  return { id, pipeline: null, status: "running", error: null, started: null, source: null, documentTokens: null,
           prefill: null, report: null, nodes: new Map(), edges: [], finished: null };
}

function nodeOf(run, name) {
  if (!run.nodes.has(name)) {
    run.nodes.set(name, { name, kind: "agent", model: null, member: null, upstream: [], state: "waiting", path: null,
                          gates: [], steps: [], fallback: null, text: "", tokens: 0, ttft: null, spent: null,
                          saved: null, error: null, note: null, tools: [], output: null, seconds: null,
                          ttftLive: false, runModel: null });
  }
  return run.nodes.get(name);
}

// The DAG of the run's pipeline: from the pipelines list when one matches the run's nodes (its edges), else nodes only.
function applyGraph(run, names) {
  const same = (p) => p.nodes.length === names.length && p.nodes.every((n) => names.includes(n.name));
  const started = app.startedWith.get(run.id);
  const pipe = app.pipelines.find((p) => p.name === started && same(p)) ||
    app.pipelines.find((p) => p.title === run.pipeline && same(p));
  for (const name of names) nodeOf(run, name);
  if (!pipe) return;
  for (const info of pipe.nodes) {
    const node = nodeOf(run, info.name);
    node.kind = info.kind;
    node.upstream = info.upstream;
    node.model = node.model || info.model;
    node.member = node.member || info.member;
  }
}

const STATE_OF_REPORT = { succeeded: "succeeded", failed: "failed", skipped: "skipped", cancelled: "failed", degenerate: "failed" };

function applyReport(run, report) {
  run.report = report;
  for (const a of report.agents) {
    const node = nodeOf(run, a.name);
    node.state = STATE_OF_REPORT[a.status] || node.state;
    node.path = a.cache_path || node.path;
    node.ttft = a.ttft_s;
    node.ttftLive = false;
    node.spent = a.prefill_s_spent;
    node.saved = a.prefill_s_saved;
    node.tokens = a.tokens || node.tokens;
    if (a.model !== node.model) node.member = a.model;
    node.seconds = a.generation_s;
    if (a.gate && a.gate.length) node.gates = a.gate.map((g) => ({ gate: g.gate, passed: g.passed, reason: g.reason, metrics: g.metrics || {} }));
    node.fallback = a.fallback_reason || node.fallback;
    if (a.status === "degenerate") node.note = `degenerate: ${a.degenerate_reason || ""}`;
    if (a.status === "cancelled") node.note = "cancelled";
    if (!node.text && a.output) node.text = a.output;
  }
}

const HANDLERS = {
  run_started(run, ev) {
    run.started = ev.at; run.source = ev.source_model; run.documentTokens = ev.document_tokens;
    applyGraph(run, ev.agents);
  },
  document_prefilled(run, ev) { run.prefill = ev; },
  cache_step(run, ev) { if (ev.agent) nodeOf(run, ev.agent).steps.push(ev.step); },
  agent_started(run, ev) {
    const node = nodeOf(run, ev.agent);
    // events name an agent's model as the run knows it: the server's member, or the pipeline's alias under `run --ui`
    node.state = "running"; node.runModel = ev.model;
    if (ev.model === "step") node.kind = "step";
    else if (ev.model !== node.model) node.member = ev.model;
  },
  cache_ready(run, ev) {
    // events of older servers name only the member: then it is the running agent on it still without a path
    const node = ev.agent ? nodeOf(run, ev.agent)
      : [...run.nodes.values()].find((n) => n.state === "running" && n.runModel === ev.model && !n.path);
    if (node && node.path !== "reprefilled") node.path = ev.path;
  },
  token(run, ev) {
    const node = nodeOf(run, ev.agent);
    node.text += ev.text; node.tokens = ev.index + 1;
    // an estimate from the events' clocks until the report gives the measured one
    if (node.ttft === null && run.started !== null) { node.ttft = ev.at - run.started; node.ttftLive = true; }
  },
  gate(run, ev) { nodeOf(run, ev.agent).gates.push({ gate: null, passed: ev.passed, reason: ev.reason, metrics: ev.metrics }); },
  fallback(run, ev) { const node = nodeOf(run, ev.agent); node.fallback = ev.reason; node.path = "reprefilled"; },
  agent_finished(run, ev) { const node = nodeOf(run, ev.agent); node.state = "succeeded"; node.output = ev.output; if (!node.text) node.text = ev.output; },
  agent_failed(run, ev) { const node = nodeOf(run, ev.agent); node.state = "failed"; node.error = `${ev.error_type}: ${ev.error}`; },
  agent_skipped(run, ev) { const node = nodeOf(run, ev.agent); node.state = "skipped"; node.note = ev.reason; },
  agent_degenerate(run, ev) { const node = nodeOf(run, ev.agent); node.state = "failed"; node.note = `degenerate: ${ev.reason}`; },
  agent_restored(run, ev) { const node = nodeOf(run, ev.agent); node.state = STATE_OF_REPORT[ev.status] || "succeeded"; node.note = "kept from the checkpoint"; if (ev.output) node.text = ev.output; },
  tool_call(run, ev) { nodeOf(run, ev.agent).tools.push(`call ${ev.tool}(${JSON.stringify(ev.arguments)})`); },
  tool_result(run, ev) { nodeOf(run, ev.agent).tools.push(`${ev.ok ? "result" : "error"} ${ev.tool}: ${ev.result}`); },
  run_finished(run, ev) { run.finished = ev; if (ev.report) applyReport(run, ev.report); },
  end(run, ev) {
    run.status = ev.status; run.error = ev.error;
    for (const node of run.nodes.values()) if (node.state === "running") { node.state = "failed"; node.note = ev.status; }
  },
};

function handleFrame(run, frame) {
  let kind = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  const handler = HANDLERS[kind];
  if (handler) handler(run, JSON.parse(data.join("\n")));
  scheduleRender();
}

async function follow(run) {
  const ctrl = new AbortController();
  app.stream = ctrl;
  try {
    const res = await api(`/v1/runs/${encodeURIComponent(run.id)}/events`, { signal: ctrl.signal,
                                                                            headers: { Accept: "text/event-stream" } });
    if (!res.ok) throw new ApiError(await errorText(res));
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (app.run === run) handleFrame(run, frame);
      }
    }
  } catch (err) {
    if (ctrl.signal.aborted) return;  // another run was selected
    throw err;
  } finally {
    if (app.stream === ctrl) app.stream = null;
  }
  if (app.run === run) quietly(refresh());
}

function stopPolling() {
  for (const timer of app.timers) clearInterval(timer);
  app.timers = [];
}

function selectRun(id) {
  if (app.run && app.run.id === id) return;
  if (app.stream) app.stream.abort();
  const summary = app.runs.find((r) => r.id === id);
  app.run = newRun(id);
  app.run.pipeline = summary ? summary.pipeline : null;
  app.selectedNode = null;
  app.drawn = "";
  for (const item of $("runs").children) item.classList.toggle("selected", item.dataset.run === id);
  scheduleRender();
  quietly(follow(app.run));
}

// -- drawing ---------------------------------------------------------------------------------------------------------
function scheduleRender() {
  if (app.pending) return;
  app.pending = true;
  requestAnimationFrame(() => { app.pending = false; render(); });
}

function render() {
  const run = app.run;
  renderHeader(run);
  if (!run) return;
  const key = [...run.nodes.values()].map((n) => `${n.name}<${n.upstream.join(",")}`).join("|") + `|${run.source}`;
  if (key !== app.drawn) { drawGraph(run); drawPanels(run); app.drawn = key; }
  updateGraph(run);
  updatePanels(run);
  renderDetail(run);
}

function renderHeader(run) {
  $("run-title").textContent = run ? `Run ${run.id}${run.pipeline ? ` · ${run.pipeline}` : ""}` : "No run selected";
  const status = $("run-status");
  status.replaceChildren();
  status.dataset.status = run ? run.status : "";
  if (!run) return;
  status.append(el("span", { class: `badge ${run.status}` }, run.status));
  const error = $("run-error");
  error.hidden = !run.error;
  error.textContent = run.error || "";
  const report = run.report;
  const items = [
    ["source", run.source || "–"],
    ["document tokens", run.documentTokens === null ? "–" : run.documentTokens.toLocaleString()],
    ["document prefill", run.prefill ? `${secs(run.prefill.seconds)}${run.prefill.store_hit ? " (cached)" : ""}` : "–"],
    ["first token", firstToken(run)],
    ["prefill spent", report ? secs(report.prefill_s_spent) : "–"],
    ["prefill saved", report ? secs(report.prefill_s_saved) : "–"],
    ["run", report ? secs(report.seconds) : "–"],
  ];
  $("run-metrics").replaceChildren(...items.map(([k, v]) => el("div", { "data-metric": k }, el("dt", {}, k), el("dd", {}, v))));
}

function firstToken(run) {
  const times = [...run.nodes.values()].map((n) => n.ttft).filter((t) => t !== null && t !== undefined);
  return times.length ? secs(Math.min(...times)) : "–";
}

function drawGraph(run) {
  const g = new dagre.graphlib.Graph();
  g.setGraph({ rankdir: "LR", nodesep: 22, ranksep: 56, marginx: 10, marginy: 10 });
  g.setDefaultEdgeLabel(() => ({}));
  g.setNode(DOC_NODE, { width: 150, height: 58 });
  for (const node of run.nodes.values()) g.setNode(node.name, { width: 176, height: 66 });
  for (const node of run.nodes.values()) {
    const ups = node.upstream.filter((u) => run.nodes.has(u));
    if (!ups.length) g.setEdge(DOC_NODE, node.name);
    for (const up of ups) g.setEdge(up, node.name);
  }
  dagre.layout(g);
  const dag = $("dag");
  const size = g.graph();
  dag.setAttribute("width", Math.ceil(size.width));
  dag.setAttribute("height", Math.ceil(size.height));
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto" });
  marker.append(svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#8a94a3" }));
  defs.append(marker);
  dag.replaceChildren(defs);
  for (const e of g.edges()) {
    const pts = g.edge(e).points;
    dag.append(svg("path", { class: "edge", d: pts.map((p, i) => `${i ? "L" : "M"}${p.x},${p.y}`).join(" ") }));
  }
  for (const name of g.nodes()) dag.append(drawNode(name, g.node(name)));
}

function drawNode(name, box) {
  const group = svg("g", { class: "node", "data-node": name, transform: `translate(${box.x - box.width / 2},${box.y - box.height / 2})` });
  group.append(svg("title"), svg("rect", { class: "box", width: box.width, height: box.height }));
  const lines = [["name", 18], ["member", 35], ["path", 52]];
  for (const [cls, y] of lines) group.append(svg("text", { class: cls, x: 10, y }));
  if (name === DOC_NODE) group.classList.add("doc");
  group.addEventListener("click", () => { app.selectedNode = name; scheduleRender(); });
  return group;
}

function updateGraph(run) {
  for (const group of $("dag").querySelectorAll("g.node")) {
    const name = group.dataset.node;
    const [title, , nameText, memberText, pathText] = group.children;
    group.classList.toggle("selected", app.selectedNode === name);
    if (name === DOC_NODE) {
      const p = run.prefill;
      nameText.textContent = "document";
      memberText.textContent = `prefill on ${run.source || "source"}`;
      pathText.textContent = p ? `${p.tokens} tokens · ${secs(p.seconds)}${p.store_hit ? " · cached" : ""}` : "";
      title.textContent = "The document, prefilled once on the source member";
      continue;
    }
    const node = run.nodes.get(name);
    if (!node) continue;
    for (const s of STATES) group.classList.toggle(`state-${s}`, node.state === s);
    for (const p of PATHS) group.classList.toggle(`path-${p}`, node.path === p);
    group.dataset.state = node.state;
    group.dataset.path = node.path || "";
    nameText.textContent = short(node.name);
    memberText.textContent = node.kind === "step" ? "python step" : `on ${short(node.member || node.model || "?", 19)}`;
    pathText.textContent = node.path ? node.path : node.state;
    pathText.setAttribute("class", `path ${node.path ? `path-${node.path}` : ""}`);
    title.textContent = tooltip(node);
  }
}

function tooltip(node) {
  const parts = [`${node.name} on ${node.member || node.model || "?"}: ${node.state}${node.path ? `, cache ${node.path}` : ""}`];
  for (const g of node.gates) parts.push(`gate${g.gate ? ` ${g.gate}` : ""}: ${g.passed ? "pass" : "FAIL"} ${g.reason || ""} ${metricText(g.metrics)}`);
  if (node.fallback) parts.push(`re-prefilled: ${node.fallback}`);
  if (node.ttft !== null) parts.push(`first token ${secs(node.ttft)}`);
  return parts.join("\n");
}

function metricText(metrics) {
  return Object.entries(metrics || {}).map(([k, v]) => `${k}=${typeof v === "number" ? Number(v).toPrecision(3) : v}`).join(" ");
}

function drawPanels(run) {
  $("node-panels").replaceChildren(...[...run.nodes.values()].map((node) => {
    const panel = el("div", { class: "panel", "data-node": node.name },
      el("h3", {}, el("span", { class: "title" }, node.name), el("span", { class: "chip state" }), el("span", { class: "chip path" })),
      el("div", { class: "tokens", "data-tokens": "0" }), el("div", { class: "foot" }));
    panel.addEventListener("click", () => { app.selectedNode = node.name; scheduleRender(); });
    return panel;
  }));
}

function updatePanels(run) {
  for (const panel of $("node-panels").children) {
    const node = run.nodes.get(panel.dataset.node);
    if (!node) continue;
    for (const s of STATES) panel.classList.toggle(`state-${s}`, node.state === s);
    const state = panel.querySelector(".chip.state");
    state.className = `chip state state-${node.state}`;
    state.textContent = node.state;
    const path = panel.querySelector(".chip.path");
    path.className = `chip path ${node.path ? `path-${node.path}` : ""}`;
    path.textContent = node.path || "";
    path.hidden = !node.path;
    const tokens = panel.querySelector(".tokens");
    if (tokens.textContent !== node.text) { tokens.textContent = node.text; tokens.scrollTop = tokens.scrollHeight; }
    tokens.dataset.tokens = String(node.tokens);
    const bits = [node.kind === "step" ? "python step" : `on ${node.member || node.model || "?"}`, `${node.tokens} tokens`,
                  `TTFT ${node.ttftLive ? "≈ " : ""}${secs(node.ttft)}`];
    if (node.spent !== null) bits.push(`prefill spent ${secs(node.spent)}`, `saved ${secs(node.saved)}`);
    if (node.error || node.note) bits.push(node.error || node.note);
    panel.querySelector(".foot").textContent = bits.join(" · ");
  }
}

function renderDetail(run) {
  const box = $("detail");
  const node = run.nodes.get(app.selectedNode);
  box.hidden = !node;
  if (!node) return;
  const rows = [["state", node.state], ["member", node.member || node.model || "–"], ["cache path", node.path || "–"],
    ["TTFT", secs(node.ttft)], ["tokens", node.tokens], ["generation", secs(node.seconds)],
    ["prefill spent", secs(node.spent)], ["prefill saved", secs(node.saved)]];
  if (node.fallback) rows.push(["re-prefilled because", node.fallback]);
  if (node.error) rows.push(["error", node.error]);
  if (node.note) rows.push(["note", node.note]);
  const table = el("table", {}, ...rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v))));
  const gates = el("table", { class: "gates" }, el("tr", {}, el("th", {}, "gate"), el("th", {}, "verdict"),
    el("th", {}, "reason"), el("th", {}, "metrics")),
    ...node.gates.map((g) => el("tr", {}, el("td", {}, g.gate || "–"), el("td", { class: g.passed ? "pass" : "fail" }, g.passed ? "pass" : "fail"),
      el("td", {}, g.reason || ""), el("td", {}, metricText(g.metrics)))));
  const steps = node.steps.map((s) => `${s.step} on ${s.member}${s.source ? ` from ${s.source}` : ""}: ${s.tokens} tokens, ${secs(s.seconds)}`);
  box.replaceChildren(el("h2", {}, `${node.name}`), table,
    el("h3", {}, "Gate verdicts"), node.gates.length ? gates : el("p", { class: "muted small" }, "No gate ran (an exact cache needs none)."),
    el("h3", {}, "Cache steps"), el("p", { class: "small lines" }, steps.join("\n") || "–"),
    ...(node.tools.length ? [el("h3", {}, "Tools"), el("p", { class: "small lines" }, node.tools.join("\n"))] : []));
}

// -- the cache panel -------------------------------------------------------------------------------------------------
async function loadCache() {
  const view = await getJSON("/v1/cache");
  const used = view.budget_bytes ? Math.min(100, (100 * view.used_bytes) / view.budget_bytes) : 0;
  const bar = el("div", { class: "bar" }, el("span"));
  bar.firstChild.style.width = `${used.toFixed(1)}%`;
  const paths = el("div", {}, ...PATHS.map((p) => el("span", { class: `chip path-${p}`, "data-path-count": p }, `${p} ${view.run_caches[p] || 0}`)));
  const chat = Object.entries(view.chat_lookups).map(([p, n]) => `${p} ${n}`).join(", ");
  const docs = el("table", {}, el("tr", {}, el("th", {}, "document"), el("th", {}, "copies")),
    ...view.documents.map((d) => el("tr", { "data-document": d.key },
      el("td", {}, el("div", {}, `${d.tokens} tokens`), el("div", { class: "preview" }, d.preview)),
      el("td", {}, ...d.copies.map((c) => el("div", { "data-member": c.member, "data-kind": c.kind },
        el("span", { class: `chip path-${c.kind}` }, `${c.member} · ${c.kind}`),
        ` ${c.source ? `from ${c.source} · ` : ""}${bytes(c.bytes)}${c.on_disk ? " · disk" : ""}`))))));
  $("cache-body").replaceChildren(
    el("div", {}, `${bytes(view.used_bytes)} of ${bytes(view.budget_bytes)} · ${view.entries} entries`), bar,
    el("div", {}, `hits ${view.hits} · misses ${view.misses} · joins ${view.joins} · evictions ${view.evictions} · hit rate ${(100 * view.hit_rate).toFixed(0)} %`),
    el("div", { class: "muted" }, "finished runs' caches by path:"), paths,
    el("div", {}, `fallbacks (re-prefilled after a refused map): ${view.run_fallbacks}`),
    ...(chat ? [el("div", {}, `chat prompts: ${chat}`)] : []),
    view.documents.length ? docs : el("p", { class: "muted" }, "Nothing cached yet."));
  $("cache-body").classList.remove("muted");
}

// -- start-up --------------------------------------------------------------------------------------------------------
async function refresh() {
  if (app.blocked) return;
  await loadRuns();
  await loadCache();
}

function poll() {
  // `orchestra run --ui` shows one run: once it ended nothing changes, and its server may go away
  if (app.config.mode === "run" && app.run && app.run.status !== "running") { stopPolling(); return; }
  quietly(refresh());
}

async function connect() {
  app.blocked = false;
  banner("");
  if (app.config.can_start_runs) await loadPipelines();
  else app.pipelines = (await getJSON("/v1/pipelines")).data;
  await loadRuns();
  if (app.config.run_id) selectRun(app.config.run_id);
  await loadCache();
  stopPolling();
  app.timers = [setInterval(poll, 3000)];
}

function setUpAuth() {
  $("api-key").value = apiKey();
  $("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    quietly(connect());
  });
  $("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); $("api-key").value = ""; });
}

async function main() {
  const res = await fetch(`${BASE}/ui/config.json`);
  app.config = await res.json();
  $("title").textContent = app.config.title;
  $("mode").textContent = app.config.mode === "run" ? "orchestra run --ui" : "orchestra serve";
  $("auth").hidden = !app.config.auth;
  $("start-section").hidden = !app.config.can_start_runs;
  setUpAuth();
  $("start-form").addEventListener("submit", (event) => quietly(startRun(event)));
  $("pipeline").addEventListener("change", showInputs);
  $("document-file").addEventListener("change", readFile);
  if (app.config.auth && !apiKey()) {
    banner("This server needs an API key: enter it above (it is kept in this browser only).", false);
    return;
  }
  await connect();
}

quietly(main());
