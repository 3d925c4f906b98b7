// The tokenfuse playground: streams an answer with the step trace ("tokenfuse": {"trace": true})
// and shows what happened at every step. Plain browser JavaScript, no dependencies.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "tokenfuse.apiKey";
  const KINDS = {
    agreed: "every member that ran ranked this piece first (combination skipped)",
    ensembled: "the combined distribution chose this piece",
    gated: "the gate member decided alone",
    single: "one member ran",
  };
  const state = { card: null, members: [], steps: [], pinned: null, controller: null };

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs = {}, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") e.className = v;
      else if (k.startsWith("data-")) e.setAttribute(k, v);
      else e[k] = v;
    }
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function setStatus(text, kind = "") {
    const s = $("status");
    s.textContent = text;
    s.className = kind;
  }

  function visible(text) {  // a token's text with its whitespace made visible
    return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u2192") || "\u2205";
  }

  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function prob(p) { return p === null || p === undefined ? "–" : p.toFixed(4); }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorMessage(resp) {
    try {
      const body = await resp.json();
      if (body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return resp.status + " " + resp.statusText;
  }

  // ------------------------------------------------------------------ members and controls
  async function connect() {
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    setStatus("connecting…");
    let resp;
    try {
      resp = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      setStatus("cannot reach the server: " + e.message, "error");
      return false;
    }
    if (!resp.ok) {
      const msg = await errorMessage(resp);
      document.body.dataset.connected = "false";
      setStatus(resp.status === 401 ? "this server needs an API key: enter it and press Connect (" + msg + ")"
                                    : msg, "error");
      return false;
    }
    const card = (await resp.json()).data[0];
    state.card = card;
    state.members = card.tokenfuse.members.map((m) => m.name);
    fillControls(card);
    document.body.dataset.connected = "true";
    setStatus("connected", "ok");
    return true;
  }

  function fillControls(card) {
    const tf = card.tokenfuse;
    $("model-info").textContent = card.id + ": " + state.members.join(" + ") + " · " + tf.method
      + (tf.gate ? " · gate " + tf.gate + " ≤ " + tf.threshold : "");
    const method = $("method");
    if (![...method.options].some((o) => o.value === tf.method)) method.append(el("option", { value: tf.method }, tf.method));
    method.value = tf.method;
    $("params").value = Object.entries(tf.params || {}).map(([k, v]) => k + "=" + v).join(", ");

    const weights = $("weights");
    weights.replaceChildren(el("span", { class: "group-label" }, "weights"));
    tf.members.forEach((m, i) => {
      const id = "weight-" + i;
      const label = el("label", { htmlFor: id, class: "best-" + (i % 8) }, m.name);
      const input = el("input", { id, type: "number", min: "0", step: "0.1", value: String(m.weight),
                                  "data-member": m.name, "data-default": String(m.weight) });
      weights.append(label, input);
    });

    const gate = $("gate");
    gate.replaceChildren();
    if (!tf.gate) gate.append(el("option", { value: "" }, "(none)"));
    for (const name of state.members) gate.append(el("option", { value: name }, name));
    gate.value = tf.gate || "";
    $("threshold").value = tf.threshold === null || tf.threshold === undefined ? "" : String(tf.threshold);

    const legend = $("member-legend");
    legend.replaceChildren(el("span", { class: "group-label" }, "underline: highest probability for the piece"));
    state.members.forEach((name, i) => legend.append(el("span", { class: "member-swatch best-" + (i % 8) }, name)));
  }

  function parseParams(text) {
    const params = {};
    for (const part of text.split(",")) {
      if (!part.trim()) continue;
      const eq = part.indexOf("=");
      if (eq < 0) throw new Error("params: write KEY=VALUE, got " + JSON.stringify(part.trim()));
      const raw = part.slice(eq + 1).trim();
      let value = raw;
      try { value = JSON.parse(raw); } catch (_) { /* a plain string */ }
      params[part.slice(0, eq).trim()] = value;
    }
    return params;
  }

  function number(id) {
    const v = $(id).value.trim();
    return v === "" ? undefined : Number(v);
  }

  function buildRequest() {
    const chat = $("chat").checked;
    const prompt = $("prompt").value;
    const body = chat ? { messages: [{ role: "user", content: prompt }] } : { prompt };
    body.stream = true;
    body.stream_options = { include_usage: true };
    for (const [field, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"],
                               ["seed", "seed"]]) {
      const v = number(id);
      if (v !== undefined) body[field] = v;
    }
    const stops = $("stop").value.split("\n").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
      .filter((s) => s !== "");
    if (stops.length) body.stop = stops;

    const tf = { trace: true, trace_k: number("trace-k") ?? 5 };
    const card = state.card.tokenfuse;
    const method = $("method").value;
    const params = parseParams($("params").value);
    if (method !== card.method) tf.method = method;
    if (JSON.stringify(params) !== JSON.stringify(card.params || {}) || (tf.method && Object.keys(params).length)) {
      tf.params = params;
    }
    const weights = {};
    let changed = false;
    for (const input of $("weights").querySelectorAll("input")) {
      weights[input.dataset.member] = Number(input.value);
      changed = changed || Number(input.value) !== Number(input.dataset.default);
    }
    if (changed) tf.weights = weights;
    const gate = $("gate").value;
    const threshold = number("threshold");
    if (gate && (gate !== card.gate || threshold !== (card.threshold ?? undefined))) {
      tf.gate = gate;
      if (threshold !== undefined) tf.threshold = threshold;
    }
    body.tokenfuse = tf;
    return { body, url: chat ? "v1/chat/completions" : "v1/completions" };
  }

  // ------------------------------------------------------------------ one step = one piece
  function kindOf(step) {
    if (step.gated) return "gated";
    if (step.ensembled) return step.skipped ? "agreed" : "ensembled";
    return "single";
  }

  function bestMember(step) {  // the member that gave the chosen piece the highest probability
    let best = -1;
    step.members.forEach((m, i) => {
      if (m.computed && m.piece_prob !== null && (best < 0 || m.piece_prob > step.members[best].piece_prob)) best = i;
    });
    return best;
  }

  function addStep(step) {
    const i = state.steps.length;
    state.steps.push(step);
    const kind = kindOf(step);
    const best = bestMember(step);
    const span = el("span", { "data-step": String(i), "data-kind": kind,
                              "data-best": best >= 0 ? step.members[best].name : "" });
    span.className = (step.end ? "end-mark" : "piece") + " kind-" + kind + (best >= 0 ? " best-" + (best % 8) : "")
      + (step.text === "" && !step.end ? " empty" : "");
    span.textContent = step.end ? "\u220e" : step.text;
    span.title = (step.end ? "END" : JSON.stringify(step.token)) + " · p=" + prob(step.prob) + " · " + KINDS[kind]
      + (best >= 0 ? " · best: " + step.members[best].name : "");
    $("output").append(span);
  }

  function showStep(i) {
    const step = state.steps[i];
    if (!step) return;
    const panel = $("topk");
    panel.hidden = false;
    panel.dataset.step = String(i);
    const kind = kindOf(step);
    $("topk-title").textContent = "step " + step.step + ": " + (step.end ? "END" : visible(step.token))
      + " · combined p=" + prob(step.prob) + " · " + kind + (step.cut ? " · cut by a stop string" : "");
    const tables = $("topk-tables");
    tables.replaceChildren();
    tables.append(topTable("combined", "combined", step.top, step, null));
    step.members.forEach((m, idx) => tables.append(topTable(m.name, "member", m.top, step, m, idx)));
  }

  function topTable(name, role, top, step, member, idx) {
    const table = el("table", { class: "topk " + role + (idx !== undefined ? " best-" + (idx % 8) : ""),
                                "data-member": name });
    let caption = name;
    if (member) {
      caption += member.computed ? (member.holds_piece ? " · piece p=" + prob(member.piece_prob) : " · no such token")
                                 : " · did not run";
    }
    table.append(el("caption", {}, caption));
    if (!top) {
      const row = el("tr", { class: "none" });
      row.append(el("td", { colSpan: 3 }, "–"));
      table.append(row);
      return table;
    }
    for (const e of top) {
      const chosen = step.end ? e.end : !e.end && e.bytes === step.bytes && step.bytes !== "";
      const row = el("tr", { class: chosen ? "chosen" : "", "data-text": e.text });
      if (e.id !== undefined && e.id !== null) row.setAttribute("data-token-id", String(e.id));
      row.append(el("td", { class: "tok" }, e.end ? "END" : visible(e.text)),
                 el("td", { class: "p" }, prob(e.prob)),
                 bar(e.prob));
      table.append(row);
    }
    return table;
  }

  function bar(p) {
    const td = el("td", { class: "bar" });
    const b = el("span");
    b.style.width = Math.round(60 * (p || 0)) + "px";
    td.append(b);
    return td;
  }

  // ------------------------------------------------------------------ the run
  function resetRun() {
    state.steps = [];
    state.pinned = null;
    $("output").replaceChildren();
    $("topk").hidden = true;
    for (const id of ["stat-steps", "stat-ms", "stat-first", "stat-ensembled", "stat-agreed", "stat-gated",
                      "stat-finish"]) {
      $(id).textContent = "–";
      delete $(id).dataset.value;
    }
  }

  function setRunning(running) {
    $("run").disabled = running;
    $("stop-run").disabled = !running;
  }

  async function run() {
    if (document.body.dataset.run === "running") return;
    if (!state.card && !(await connect())) return;
    let req;
    try {
      req = buildRequest();
    } catch (e) {
      setStatus(e.message, "error");
      return;
    }
    resetRun();
    $("request-json").textContent = "POST " + req.url + "\n" + JSON.stringify(req.body, null, 2);
    document.body.dataset.run = "running";
    setRunning(true);
    setStatus("generating…");
    state.controller = new AbortController();
    const t0 = performance.now();
    const timing = { first: null, last: null };
    let outcome;
    try {
      outcome = await stream(req, state.controller.signal, timing);
    } catch (e) {
      outcome = { error: e.name === "AbortError" ? null : e.message, stopped: e.name === "AbortError" };
    }
    setRunning(false);
    showStats(outcome, t0, timing);
    if (outcome.error) {
      document.body.dataset.run = "error";
      setStatus(outcome.error, "error");
    } else if (outcome.stopped) {
      document.body.dataset.run = "stopped";
      setStatus("stopped", "");
    } else {
      document.body.dataset.run = "done";
      setStatus("done", "ok");
    }
  }

  async function stream(req, signal, timing) {
    const resp = await fetch(req.url, { method: "POST", headers: headers(), body: JSON.stringify(req.body), signal });
    if (!resp.ok) {
      const msg = await errorMessage(resp);
      return { error: (resp.status === 401 ? "API key: " : "") + msg };
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    const out = { text: "", finish: null, final: null, error: null };
    let buffer = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {  // the end of one event
          if (data.length && onEvent(data.join("\n"), out, timing)) return out;
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }  // comments (": ping") and other fields are ignored
      }
    }
    if (data.length) onEvent(data.join("\n"), out, timing);
    return out;
  }

  function onEvent(payload, out, timing) {  // true: the stream is over
    if (payload === "[DONE]") return true;
    const chunk = JSON.parse(payload);
    if (chunk.error) {
      out.error = chunk.error.message;
      return true;
    }
    const traces = chunk.tokenfuse && chunk.tokenfuse.trace;
    if (traces) {
      for (const t of traces) {
        for (const step of t.steps) addStep(step);
      }
      timing.last = performance.now();
      if (timing.first === null && state.steps.length) timing.first = timing.last;
    }
    for (const c of chunk.choices || []) {
      out.text += c.text !== undefined ? c.text : (c.delta && c.delta.content) || "";
      if (c.finish_reason) out.finish = c.finish_reason;
    }
    if (!chunk.choices || !chunk.choices.length) out.final = chunk;  // usage and the "tokenfuse" summary
    return false;
  }

  function showStats(outcome, t0, timing) {
    const steps = state.steps;
    const final = outcome.final;
    const n = final && final.usage ? final.usage.completion_tokens : steps.length;
    const ensembled = final && final.tokenfuse && final.tokenfuse.ensembled_steps !== undefined
      ? final.tokenfuse.ensembled_steps : steps.filter((s) => s.ensembled).length;
    const agreed = steps.filter((s) => s.ensembled && s.skipped).length;
    const gated = steps.filter((s) => s.gated).length;
    const end = timing.last ?? performance.now();
    const put = (id, text, value) => {
      $(id).textContent = text;
      if (value !== undefined) $(id).dataset.value = String(value);
    };
    put("stat-steps", String(n), n);
    if (n > 0) {
      const ms = (end - t0) / n;
      put("stat-ms", ms.toFixed(1), ms);
      put("stat-ensembled", pct(ensembled / n) + " (" + ensembled + "/" + n + ")", ensembled / n);
      put("stat-agreed", String(agreed), agreed);
      put("stat-gated", String(gated), gated);
    }
    if (timing.first !== null) put("stat-first", (timing.first - t0).toFixed(0) + " ms", timing.first - t0);
    put("stat-finish", outcome.finish || (outcome.stopped ? "stopped" : "–"));
    $("stats").dataset.source = final ? "server" : "client";
  }

  // ------------------------------------------------------------------ wiring
  function pieceOf(target) {
    const span = target.closest && target.closest("[data-step]");
    return span && $("output").contains(span) ? span : null;
  }

  function init() {
    $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
    $("connect").addEventListener("click", connect);
    $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") connect(); });
    $("run").addEventListener("click", run);
    $("stop-run").addEventListener("click", () => state.controller && state.controller.abort());
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); run(); }
    });
    const output = $("output");
    output.addEventListener("click", (e) => {
      const span = pieceOf(e.target);
      if (!span) return;
      for (const s of output.querySelectorAll(".selected")) s.classList.remove("selected");
      span.classList.add("selected");
      state.pinned = Number(span.dataset.step);
      showStep(state.pinned);
    });
    output.addEventListener("mouseover", (e) => {
      const span = pieceOf(e.target);
      if (span) showStep(Number(span.dataset.step));
    });
    output.addEventListener("mouseleave", () => { if (state.pinned !== null) showStep(state.pinned); });
    connect();
  }

  init();
})();
