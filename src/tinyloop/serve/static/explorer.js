// The tinyloop explorer: talks to this server's /v1/models, /v1/lens and /v1/completions (streamed).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const state = { model: null, promptIds: [], genIds: [], genLoops: [], promptLens: null, fullLens: null,
  selected: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function postJSON(path, body) {
  const res = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await res.json();
  if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
  return data;
}

function setStatus(text, error) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function visible(text) {  // whitespace made visible in token boxes
  return text.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function probColour(p) {  // white -> dark blue
  const t = Math.max(0, Math.min(1, p));
  return `rgb(${Math.round(255 - 225 * t)},${Math.round(255 - 170 * t)},${Math.round(255 - 80 * t)})`;
}

// ---- output tokens -------------------------------------------------------------------------------
function tokenSpan(index, info, cls) {
  const span = document.createElement("span");
  span.className = "token " + cls + (info.partial ? " partial" : "");
  span.dataset.index = index;
  span.textContent = visible(info.text);
  span.title = `#${index} id ${info.id}`;
  span.addEventListener("click", () => showDetail(index));
  return span;
}

function renderPrompt(tokens) {
  const out = $("output");
  out.textContent = "";
  tokens.forEach((info, i) => out.appendChild(tokenSpan(i, info, "prompt")));
}

function shadeTokens() {
  const mode = $("shade").value;
  const lens = state.fullLens;
  const maxLoops = lens ? lens.loops : Math.max(1, ...state.genLoops);
  document.querySelectorAll("#output .token.gen").forEach((span) => {
    const p = Number(span.dataset.index);
    const g = p - state.promptIds.length;
    let t = null;
    let label = "";
    if (mode === "depth" && state.genLoops[g] !== undefined) {
      t = state.genLoops[g] / maxLoops;
      label = `depth ${state.genLoops[g]} of ${maxLoops}`;
    } else if (mode === "kl" && lens && p >= 1) {
      const rows = lens.positions[p - 1].iterations;
      const kl = rows[rows.length - 1].kl_prev;
      if (kl !== null) {
        t = Math.min(1, Math.log10(1 + kl * 1e3) / 3);  // 0 at KL 0, 1 at KL >= ~1 nat
        label = `KL(last || previous) ${kl.toExponential(2)}`;
      }
    }
    span.style.background = t === null ? "" : `rgba(232, 89, 12, ${0.08 + 0.6 * t})`;
    span.title = `#${p} id ${state.genIds[g]}` + (label ? ` · ${label}` : "");
  });
}

// ---- heatmap of the prompt -----------------------------------------------------------------------
function renderHeatmap(lens) {
  const svg = $("heatmap");
  svg.textContent = "";
  const L = lens.loops, T = lens.positions.length;
  const cw = Math.max(14, Math.min(34, Math.floor(900 / T))), ch = 22, left = 70, top = 8;
  svg.setAttribute("width", left + T * cw + 10);
  svg.setAttribute("height", top + L * ch + 40);
  const hover = $("hover");
  for (let i = 0; i < L; i++) {
    const label = svgEl("text", { x: 4, y: top + i * ch + 15 }, svg);
    label.textContent = `iter ${i + 1}`;
    for (let t = 0; t < T; t++) {
      const row = lens.positions[t].iterations[i];
      const best = row.top[0];
      const cell = svgEl("rect", { x: left + t * cw, y: top + i * ch, width: cw - 1, height: ch - 1,
        fill: probColour(best.prob), class: "cell", "data-iteration": i + 1, "data-position": t }, svg);
      const info = `iteration ${i + 1}, position ${t}\ninput   ${JSON.stringify(lens.tokens[t].text)}\n` +
        `top-1   ${JSON.stringify(best.text)} p=${best.prob.toFixed(3)}\nentropy ${row.entropy.toFixed(3)}` +
        (row.kl_prev === null ? "" : `\nKL prev ${row.kl_prev.toExponential(2)}`) + (row.top1_changed ? "\ntop-1 changed" : "");
      cell.addEventListener("mousemove", (ev) => {
        const box = $("heatmap-box").getBoundingClientRect();
        hover.textContent = info;
        hover.style.display = "block";
        hover.style.left = ev.clientX - box.left + 14 + "px";
        hover.style.top = ev.clientY - box.top + 10 + "px";
      });
      cell.addEventListener("mouseleave", () => { hover.style.display = "none"; });
      cell.addEventListener("click", () => showDetail(t + 1 < state.promptIds.length + state.genIds.length ? t + 1 : t, t));
      if (row.top1_changed) {
        svgEl("circle", { cx: left + t * cw + cw / 2, cy: top + i * ch + ch / 2, r: 3, fill: "#e8590c",
          class: "change", "pointer-events": "none" }, svg);
      }
    }
  }
  for (let t = 0; t < T; t++) {
    const label = svgEl("text", { x: left + t * cw + cw / 2, y: top + L * ch + 14, "text-anchor": "middle" }, svg);
    label.textContent = visible(lens.tokens[t].text).slice(0, 4);
  }
}

// ---- the detail of one token: top-k per iteration and the KL / entropy curve --------------------
function lensAt(position) {
  if (state.fullLens && position < state.fullLens.positions.length) return state.fullLens;
  if (state.promptLens && position < state.promptLens.positions.length) return state.promptLens;
  return null;
}

function showDetail(index, position) {
  // A token at sequence index p was predicted at position p - 1: show what each iteration predicted there.
  const pos = position !== undefined ? position : index - 1;
  document.querySelectorAll("#output .token.selected").forEach((s) => s.classList.remove("selected"));
  const span = document.querySelector(`#output .token[data-index="${index}"]`);
  if (span) span.classList.add("selected");
  const table = $("lens-table");
  table.textContent = "";
  $("curve").textContent = "";
  if (pos < 0) {
    $("detail-title").textContent = "(the first token has no prediction: click a later one)";
    return;
  }
  const lens = lensAt(pos);
  if (!lens) {
    $("detail-title").textContent = "(the lens of this position is still being computed)";
    return;
  }
  const p = lens.positions[pos];
  const target = lens.tokens[pos + 1];
  $("detail-title").textContent = `position ${pos} (after ${JSON.stringify(lens.tokens[pos].text)})` +
    (target ? `, predicting token #${pos + 1} ${JSON.stringify(target.text)}` : "") +
    ` · top-1 changes ${p.top1_changes}, settled at iteration ${p.settled_at}`;
  const head = table.insertRow();
  for (const h of ["iteration", "top-1", ...Array.from({ length: lens.top_k - 1 }, (_, j) => `#${j + 2}`),
    "entropy", "KL prev"]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.appendChild(th);
  }
  p.iterations.forEach((row, i) => {
    const tr = table.insertRow();
    tr.className = "lens-row";
    tr.dataset.top1 = row.top[0].id;
    tr.insertCell().textContent = i + 1;
    row.top.forEach((c, j) => {
      const td = tr.insertCell();
      td.textContent = `${JSON.stringify(c.text)} ${c.prob.toFixed(3)}`;
      if (j === 0 && row.top1_changed) td.className = "changed";
    });
    tr.insertCell().textContent = row.entropy.toFixed(3);
    tr.insertCell().textContent = row.kl_prev === null ? "—" : row.kl_prev.toExponential(2);
  });
  drawCurve(p.iterations);
}

function drawCurve(rows) {
  const svg = $("curve");
  const W = 360, H = 200, l = 40, r = 10, t = 18, b = 28;
  const n = rows.length;
  const x = (i) => l + (n === 1 ? 0 : (i * (W - l - r)) / (n - 1));
  const series = [
    { name: "entropy (nats)", colour: "#1c7ed6", values: rows.map((row) => row.entropy) },
    { name: "KL to previous (nats)", colour: "#e8590c", values: rows.map((row) => row.kl_prev) },
  ];
  const all = series.flatMap((s) => s.values.filter((v) => v !== null));
  const ymax = Math.max(1e-9, ...all);
  const y = (v) => H - b - (v / ymax) * (H - t - b);
  svgEl("line", { x1: l, y1: H - b, x2: W - r, y2: H - b, stroke: "#999" }, svg);
  svgEl("line", { x1: l, y1: t, x2: l, y2: H - b, stroke: "#999" }, svg);
  svgEl("text", { x: 2, y: t + 4 }, svg).textContent = ymax.toPrecision(2);
  svgEl("text", { x: l, y: H - 8 }, svg).textContent = "iteration 1";
  svgEl("text", { x: W - r, y: H - 8, "text-anchor": "end" }, svg).textContent = `${n}`;
  series.forEach((s, k) => {
    const pts = s.values.map((v, i) => (v === null ? null : `${x(i)},${y(v)}`)).filter((v) => v !== null);
    svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: s.colour, "stroke-width": 2 }, svg);
    svgEl("text", { x: l + 8 + k * 150, y: 12, fill: s.colour }, svg).textContent = s.name;
  });
}

// ---- a run: lens of the prompt, the streamed completion, then the lens of everything ---------------
async function streamCompletion(body, onChunk) {
  const res = await fetch("/v1/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!res.ok) {
    const data = await res.json();
    throw new Error((data.error && data.error.message) || res.statusText);
  }
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const payload = event.slice(6);
      if (payload === "[DONE]") return;
      const data = JSON.parse(payload);
      if (data.error) throw new Error(data.error.message);
      onChunk(data.choices[0]);
    }
  }
}

async function run() {
  $("run").disabled = true;
  document.body.dataset.done = "0";
  state.genIds = [];
  state.genLoops = [];
  state.fullLens = null;
  try {
    const loops = $("loops").value ? Number($("loops").value) : null;
    setStatus("reading the prompt…");
    state.promptLens = await postJSON("/v1/lens", { prompt: $("prompt").value, loops, top_k: 5 });
    state.promptIds = state.promptLens.tokens.map((t) => t.id);
    renderPrompt(state.promptLens.tokens);
    renderHeatmap(state.promptLens);
    setStatus("generating…");
    const body = { model: state.model, prompt: state.promptIds, max_tokens: Number($("max-tokens").value),
      temperature: Number($("temperature").value), stream: true, return_token_ids: true };
    if (loops) body.loops = loops;
    if ($("exit-criterion").value) body.exit_criterion = $("exit-criterion").value;
    await streamCompletion(body, (choice) => {
      const ids = choice.token_ids || [];
      ids.forEach((id, j) => {
        const index = state.promptIds.length + state.genIds.length;
        state.genIds.push(id);
        const text = j === ids.length - 1 ? choice.text : "";
        $("output").appendChild(tokenSpan(index, { id, text, partial: false }, "gen"));
      });
      if (choice.token_loops) state.genLoops = choice.token_loops;
    });
    shadeTokens();
    setStatus("reading the whole sequence…");
    state.fullLens = await postJSON("/v1/lens", { tokens: state.promptIds.concat(state.genIds), loops, top_k: 5 });
    state.fullLens.tokens.forEach((info, i) => {  // each token's own text (partial UTF-8 bytes in hex)
      const span = document.querySelector(`#output .token[data-index="${i}"]`);
      if (span) {
        span.textContent = visible(info.text);
        span.classList.toggle("partial", info.partial);
      }
    });
    shadeTokens();
    setStatus(`${state.genIds.length} tokens generated` + (state.genLoops.length ?
      `, mean depth ${(state.genLoops.reduce((a, b) => a + b, 0) / state.genLoops.length).toFixed(2)}` : ""));
    document.body.dataset.done = "1";
  } catch (err) {
    setStatus(err.message, true);
  } finally {
    $("run").disabled = false;
  }
}

async function init() {
  $("run").addEventListener("click", run);
  $("shade").addEventListener("change", shadeTokens);
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    const data = await res.json();
    if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
    state.model = data.data[0].id;
    $("model-name").textContent = `model: ${state.model}`;
  } catch (err) {
    $("model-name").textContent = "model: ?";
    setStatus(err.message, true);
  }
}

init();
