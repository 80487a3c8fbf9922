// The live dashboard: the page embeds the state and recent steps, then /dashboard/stream sends
// at most ~10 `frame` events a second, each with every step since the last frame + the state
// (and, under tensor parallelism, each rank's times in the latest step).
// Charts are plain inline SVG, redrawn at most once per animation frame.
(() => {
  "use strict";
  const script = document.currentScript;
  const data = JSON.parse(document.getElementById("dashboard-data").textContent);
  const MAX = data.chart_steps;
  const SPEC = data.speculation; // the engine's setting; each step says whether it speculated
  let steps = data.steps;
  let state = data.state;
  let ranks = data.ranks; // tensor parallelism: each rank's times in the latest step ([]: one)
  let queued = false;

  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  const SVG = "http://www.w3.org/2000/svg";
  const pct = (x) => (x === null || x === undefined ? "—" : (x * 100).toFixed(1) + "%");
  const lastSpec = () => (state.batch ? state.batch.speculation : "");

  // ---- the current batch and the summary -------------------------------------------------
  function renderSummary() {
    const live = $("live");
    live.textContent = state.idle ? "idle" : "running";
    live.className = "live " + (state.idle ? "idle" : "on");
    $("sum-step").textContent = state.step;
    $("sum-running").textContent = state.running;
    $("sum-waiting").textContent = state.waiting;
    $("sum-kv").textContent = Math.round(100 * state.kv.used / state.kv.num_blocks) + "%";
    const last = steps[steps.length - 1];
    $("sum-tps").textContent = state.tokens_per_s.toFixed(1); // now: 0 once idle
    $("sum-spec").textContent = SPEC.enabled ? (lastSpec() || "on") : "not configured";
    $("sum-accept").textContent = pct(last ? last.acceptance_rolling : null);
  }

  // Built with DOM calls and text nodes: request ids and labels never pass through innerHTML
  // (what still does below is numbers, constants and esc()-escaped strings).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else if (name === "hue") node.style.setProperty("--h", String(value));
      else node.setAttribute(name, String(value));
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function renderBatch() {
    const b = state.batch;
    const caption = $("batch-caption");
    if (b) {
      const spec = b.speculation ? [" · speculation ", el("span", {class: "spec-state",
        title: b.speculation === "on" ? "drafts were proposed for the requests in decode"
          : "no drafts this step"}, b.speculation),
        ...(b.draft_tokens ? [` · drafts ${b.accepted_tokens}/${b.draft_tokens} accepted`]
          : [])] : [];
      const mask = b.constrained_rows ? [" · ", el("span", {class: "constrained", title:
        "rows held to a grammar (structured outputs, forced tool calls); their matchers " +
        `took ${b.mask_ms.toFixed(2)} ms to compute the masks`},
        `${b.constrained_rows} constrained, mask ${b.mask_ms.toFixed(2)} ms`)] : [];
      const overlap = b.overlapped ? [" · ", el("span", {class: "overlapped", title:
        "async scheduling: built and queued while the step before computed; discarded rows " +
        "were computed for requests that ended on that step"}, "overlapped"),
        ...(b.discarded_rows ? [`, ${b.discarded_rows} discarded`] : [])] : [];
      caption.replaceChildren(
        "step ", el("b", {}, b.step),
        ` · ${b.total_rows} rows (${b.prefill_rows} prefill, ${b.decode_rows} decode, ` +
        `${b.verify_rows} verify) · `,
        el("span", {class: `path path-${b.kernel_path}`}, b.kernel_path),
        ` · ${(b.wall_time * 1000).toFixed(1)} ms`, ...spec, ...mask, ...overlap);
    } else {
      caption.replaceChildren("no step yet");
    }
    const rows = (b ? b.entries : []).map((e) => el("tr", {"data-request": e.id},
      el("td", {title: e.id}, el("span", {class: "swatch", hue: e.hue}), e.label),
      el("td", {class: `phase phase-${e.phase}`}, e.phase,
         ...(e.sampled ? [" ", el("span", {title: "sampled a token"}, "✓")] : [])),
      el("td", {class: "num"}, e.rows),
      el("td", {class: "num drafts"}, ...(e.phase === "verify" ? [el("span", {title:
        `${e.accepted} of ${e.drafted} drafted tokens accepted: ${e.accepted + 1} tokens ` +
        "this step"}, `${e.accepted}/${e.drafted}`)] : [])),
      el("td", {class: "num"}, e.context_len),
      el("td", {class: "num"}, e.blocks_held)));
    $("batch-table").tBodies[0].replaceChildren(...(rows.length ? rows
      : [el("tr", {class: "empty"}, el("td", {colspan: 6}, "no request in the latest step"))]));
  }

  // ---- the KV block map: cells are kept and only changed ones touched ---------------------
  let kvKeys = [];
  function renderKV() {
    const kv = state.kv;
    const map = $("kv-map");
    if (map.children.length !== kv.num_blocks) {
      map.innerHTML = '<i class="blk free"></i>'.repeat(kv.num_blocks);
      kvKeys = [];
    }
    const cells = map.children;
    for (let b = 0; b < kv.num_blocks; b++) {
      const c = kv.cells[b];
      const holders = kv.shared[b] || (c > 0 ? [c] : []);
      const key = c > 0 ? holders.join(",") : c;
      if (kvKeys[b] === key) continue;
      kvKeys[b] = key;
      const el = cells[b];
      if (c > 0) {
        el.className = "blk held" + (holders.length > 1 ? " shared" : "");
        el.style.setProperty("--h", kv.requests[c - 1].hue);
        el.title = `block ${b}: ` + holders.map((k) => kv.requests[k - 1].id).join(", ");
      } else {
        el.className = c < 0 ? "blk cached" : "blk free";
        el.style.removeProperty("--h");
        el.title = `block ${b}: ` + (c < 0 ? "cached prefix (evictable)" : "free");
      }
    }
    $("kv-caption").innerHTML =
      `${kv.num_blocks} blocks × ${kv.block_size} tokens · ` +
      `<span class="key key-held"></span> held <b>${kv.used}</b> · ` +
      `<span class="key key-cached"></span> cached prefix <b>${kv.cached}</b> · ` +
      `<span class="key key-free"></span> free <b>${kv.free}</b>`;
  }

  // ---- the recurrent-state pool (models with recurrent layers) -----------------------------
  function bytes(n) { // render.py: fmt_bytes
    if (n < 1024) return `${n} B`;
    let value = n / 1024, unit = "KiB";
    for (const bigger of ["MiB", "GiB"]) {
      if (value < 1024) break;
      value /= 1024;
      unit = bigger;
    }
    return `${value.toFixed(1)} ${unit}`;
  }

  function renderStatePool() {
    const sp = state.state_pool;
    if (!$("state-pool") || !sp) return; // no recurrent layers: the page has no such section
    $("state-slot-bytes").textContent = bytes(sp.slot_bytes);
    $("state-slots").textContent = `${sp.slots_used} / ${sp.slots_total}`;
    $("state-slots-bar").style.setProperty("--f", (sp.slots_used / sp.slots_total).toFixed(3));
    $("state-ckpt").textContent = `${sp.checkpoints} / ${sp.checkpoint_capacity}`;
    $("state-ckpt-bar").style.setProperty("--f", (sp.checkpoint_capacity
      ? sp.checkpoints / sp.checkpoint_capacity : 0).toFixed(3));
    $("state-hits").textContent = sp.checkpoint_hits;
  }

  // ---- tensor-parallel ranks (a server with --tensor-parallel-size > 1) -------------------
  function renderRanks() {
    if (!$("rank-rows") || !ranks.length) return; // one rank: the page has no such section
    const ms = (s) => (s === null ? "–" : (s * 1000).toFixed(2));
    const slowest = Math.max(0, ...ranks.map((r) => r.wall_s || 0));
    $("rank-rows").replaceChildren(...ranks.map((r) => el("tr", {"data-rank": r.rank},
      el("td", {}, String(r.rank)), el("td", {class: "num"}, String(r.port)),
      el("td", {class: "num"}, ms(r.wall_s)), el("td", {class: "num"}, ms(r.model_s)),
      el("td", {class: "num"}, ms(r.all_sum_s)), el("td", {class: "num"}, ms(r.broadcast_s)),
      el("td", {}, el("span", {class: "meter"}, el("i", {style: "--f: " +
        (slowest && r.wall_s !== null ? r.wall_s / slowest : 0).toFixed(3)}))))));
  }

  // ---- kernel-path strip ------------------------------------------------------------------
  function renderStrip() {
    const top = Math.max(1, ...steps.map((s) => s.total_rows));
    $("kernel-strip").innerHTML = steps.map((s) =>
      `<i class="mark path-${esc(s.kernel_path)}" ` +
      `style="--f: ${Math.sqrt(s.total_rows / top).toFixed(3)}; ` +
      `--v: ${(s.total_rows ? s.verify_rows / s.total_rows : 0).toFixed(3)}" ` +
      `title="step ${s.step}: ${esc(s.kernel_path)}, ${s.total_rows} rows` +
      `${s.verify_rows ? ` (${s.verify_rows} verify)` : ""}` +
      `${s.constrained_rows ? `, ${s.constrained_rows} constrained (mask ` +
        `${s.mask_ms.toFixed(2)} ms)` : ""}"></i>`).join("");
  }

  // ---- expert load (mixture-of-experts models): cells are kept, only shade and title change ---
  function spread(l) {
    return l.total ? (l.max * l.rows.length / l.total).toFixed(1) + "×" : "–";
  }

  function renderExperts() {
    const map = $("expert-map");
    const ex = state.experts;
    if (!map || !ex) return; // a dense model: the page has no expert section
    $("experts-caption").replaceChildren(
      ex.steps ? `rows each expert received in the last ${ex.steps} steps ` +
        `(${ex.first_step}–${ex.last_step}), a row once per expert it chose` : "no step yet",
      " · darker: more rows, relative to the layer's busiest expert · right: busiest / mean");
    const shape = ex.layers.map((l) => `${l.layer}:${l.rows.length}`).join(",");
    if (map.dataset.shape !== shape) {
      map.style.setProperty("--n", String(ex.num_experts));
      map.replaceChildren(...ex.layers.map((l) => el("div",
        {class: "expert-layer", "data-layer": l.layer},
        el("span", {class: "expert-label"}, `L${l.layer}`),
        el("span", {class: "expert-cells"}, ...l.rows.map(() => el("i", {class: "xc"}))),
        el("span", {class: "expert-spread num"}))));
      map.dataset.shape = shape;
    }
    ex.layers.forEach((l, row) => {
      const line = map.children[row];
      const cells = line.children[1].children;
      l.rows.forEach((n, e) => {
        cells[e].style.setProperty("--f", (l.max ? n / l.max : 0).toFixed(3));
        cells[e].title = `layer ${l.layer}, expert ${e}: ${n} rows`;
      });
      line.children[2].textContent = spread(l);
    });
  }

  // ---- charts -----------------------------------------------------------------------------
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= v);
  }

  // series: [{label, color, value(step), now}]; kind: "line" | "bars" (stacked) | "area"
  // (stacked). A series with `now` shows that value in its legend (what the engine holds or
  // does now, as the rest of the page says) instead of the last step's.
  function chart(id, series, kind, fixedMax) {
    const box = $(id);
    const svg = box.querySelector("svg");
    const w = svg.clientWidth || 600, h = svg.clientHeight || 140;
    const left = 34, top = 6, bottom = h - 4, dx = (w - left) / MAX;
    const x0 = left + (MAX - steps.length) * dx; // the newest step sits at the right edge
    const stacked = kind !== "line";
    const totals = steps.map((s) => series.reduce((a, se) => a + se.value(s), 0));
    const peak = stacked ? Math.max(0, ...totals)
      : Math.max(0, ...series.flatMap((se) => steps.map(se.value)));
    const ymax = fixedMax || niceMax(peak);
    const y = (v) => bottom - (v / ymax) * (bottom - top);
    let out = `<line class="axis" x1="${left}" x2="${w}" y1="${y(0)}" y2="${y(0)}"/>` +
      `<line class="axis" x1="${left}" x2="${w}" y1="${y(ymax)}" y2="${y(ymax)}"/>` +
      `<text x="${left - 4}" y="${y(ymax) + 8}" text-anchor="end">${ymax}</text>` +
      `<text x="${left - 4}" y="${bottom}" text-anchor="end">0</text>`;
    const base = steps.map(() => 0);
    for (const se of series) {
      const vals = steps.map(se.value);
      let d = "";
      if (kind === "line") {
        d = vals.map((v, i) => `${i ? "L" : "M"}${(x0 + (i + 0.5) * dx).toFixed(1)} ` +
          `${y(v).toFixed(1)}`).join("");
        out += `<path d="${d}" fill="none" stroke="${se.color}" stroke-width="1.5"/>`;
      } else if (kind === "bars") {
        const bw = Math.max(1, dx - (dx > 3 ? 1 : 0)).toFixed(1);
        vals.forEach((v, i) => {
          if (v > 0) {
            const ya = y(base[i]), yb = y(base[i] + v);
            d += `M${(x0 + i * dx).toFixed(1)} ${ya.toFixed(1)}h${bw}V${yb.toFixed(1)}h-${bw}Z`;
          }
          base[i] += v;
        });
        out += `<path d="${d}" fill="${se.color}"/>`;
      } else {
        const upper = vals.map((v, i) => base[i] + v);
        const pts = (arr) => arr.map((v, i) => `${(x0 + (i + 0.5) * dx).toFixed(1)} ` +
          `${y(v).toFixed(1)}`);
        if (steps.length) {
          d = "M" + pts(upper).join("L") + "L" + pts(base).reverse().join("L") + "Z";
        }
        upper.forEach((v, i) => { base[i] = v; });
        out += `<path d="${d}" fill="${se.color}" stroke="none"/>`;
      }
    }
    svg.innerHTML = out;
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    const last = steps[steps.length - 1];
    const shown = (se) => ("now" in se ? se.now : last ? se.value(last) : null);
    box.querySelector(".legend").innerHTML = series.map((se) =>
      `<span><i style="background:${se.color}"></i>${se.label}` +
      `${shown(se) === null ? "" : " " + (+shown(se).toFixed(1))}</span>`).join("") +
      (series.some((se) => "now" in se) ? '<span class="muted">(now)</span>' : "");
  }

  const style = getComputedStyle($("dashboard"));
  const css = (name) => style.getPropertyValue(name).trim();
  function renderCharts() {
    chart("chart-requests", [
      {label: "running", color: css("--running"), value: (s) => s.num_running},
      {label: "waiting", color: css("--waiting"), value: (s) => s.num_waiting},
    ], "line");
    chart("chart-rows", [
      {label: "prefill", color: css("--prefill"), value: (s) => s.prefill_rows},
      {label: "decode", color: css("--decode"), value: (s) => s.decode_rows},
      {label: "verify", color: css("--verify"), value: (s) => s.verify_rows},
    ], "bars");
    chart("chart-kv", [
      {label: "used", color: css("--used"), value: (s) => s.kv_blocks_used, now: state.kv.used},
      {label: "cached", color: css("--cached"), value: (s) => s.kv_blocks_cached,
       now: state.kv.cached},
      {label: "free", color: css("--free"), value: (s) => s.kv_blocks_free, now: state.kv.free},
    ], "area", state.kv.num_blocks);
    chart("chart-tokens", [
      {label: "tok/s", color: css("--decode"), value: (s) => s.tokens_per_s,
       now: state.tokens_per_s},
    ], "line");
    renderAcceptance();
  }

  // ---- speculative decoding: accepted / drafted, per step (bars) and rolling (line) --------
  function renderAcceptance() {
    const box = $("chart-accept");
    const svg = box.querySelector("svg");
    const w = svg.clientWidth || 600, h = svg.clientHeight || 140;
    const left = 34, top = 6, bottom = h - 4, dx = (w - left) / MAX;
    const x0 = left + (MAX - steps.length) * dx;
    const y = (v) => bottom - v * (bottom - top);
    let out = `<line class="axis" x1="${left}" x2="${w}" y1="${y(0)}" y2="${y(0)}"/>` +
      `<line class="axis" x1="${left}" x2="${w}" y1="${y(1)}" y2="${y(1)}"/>` +
      `<text x="${left - 4}" y="${y(1) + 8}" text-anchor="end">100%</text>` +
      `<text x="${left - 4}" y="${bottom}" text-anchor="end">0</text>`;
    const bw = Math.max(1, dx - (dx > 3 ? 1 : 0)).toFixed(1);
    let bars = "", line = "", pen = "M";
    steps.forEach((s, i) => {
      if (s.acceptance !== null) {
        bars += `M${(x0 + i * dx).toFixed(1)} ${y(0).toFixed(1)}h${bw}` +
          `V${y(s.acceptance).toFixed(1)}h-${bw}Z`;
      }
      if (s.acceptance_rolling === null) { pen = "M"; return; }
      line += `${pen}${(x0 + (i + 0.5) * dx).toFixed(1)} ${y(s.acceptance_rolling).toFixed(1)}`;
      pen = "L";
    });
    out += `<path d="${bars}" fill="${css("--verify")}" fill-opacity="0.3" stroke="none"/>` +
      `<path d="${line}" fill="none" stroke="${css("--verify")}" stroke-width="1.5"/>`;
    svg.innerHTML = out;
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    const last = steps[steps.length - 1];
    box.querySelector(".legend").innerHTML =
      `<span><i style="background:${css("--verify")};opacity:.3"></i>per step ` +
      `${pct(last ? last.acceptance : null)}</span>` +
      `<span><i style="background:${css("--verify")}"></i>last ${data.acceptance_steps} ` +
      `steps ${pct(last ? last.acceptance_rolling : null)}</span>`;
    const note = $("accept-note");
    const now = lastSpec();
    const off = !SPEC.enabled || now.startsWith("off");
    note.className = "note" + (off ? " off" : "");
    if (!SPEC.enabled) {
      note.innerHTML = "speculation is not configured on this server " +
        "(<code>batchscope serve --speculative ngram</code>)";
    } else {
      note.textContent = (now.startsWith("off") ? `speculation is ${now} · ` : "") +
        SPEC.describe;
    }
  }

  function render() {
    queued = false;
    renderSummary();
    renderBatch();
    renderKV();
    renderStatePool();
    renderRanks();
    renderStrip();
    renderExperts();
    renderCharts();
  }
  const schedule = () => { if (!queued) { queued = true; requestAnimationFrame(render); } };

  // ---- the stream -------------------------------------------------------------------------
  const since = steps.length ? steps[steps.length - 1].step : state.step;
  const source = new EventSource(`${script.dataset.stream}?since=${since}`);
  source.addEventListener("frame", (ev) => {
    const frame = JSON.parse(ev.data);
    state = frame.state;
    ranks = frame.ranks;
    if (frame.steps.length) steps = steps.concat(frame.steps).slice(-MAX);
    schedule();
  });
  source.addEventListener("error", () => {
    $("live").textContent = "reconnecting";
    $("live").className = "live idle";
  });
  window.addEventListener("resize", schedule);
  renderCharts(); // the server drew everything but the charts
})();
