// cobatch live dashboard: reads GET /dashboard/events (server-sent events, see
// cobatch/server/dashboard/events.py for the format) and draws the metro view on a canvas.
// Plain JS, no build step, no network beyond this server.
"use strict";
(() => {
  const WINDOW = 300; // steps drawn
  const RATE_WINDOW_S = 2.0; // tokens/s over the last seconds of steps
  const MAX_RECENT = 60; // ids in the "recent requests" list
  const KIND_NAMES = { p: "prefill chunk", d: "decode", x: "padding" };
  const SEGMENT_COLORS = { waiting: "#ced4da", unscheduled: "#e03131", padding: "#9aa0a6" };
  const $ = (id) => document.getElementById(id);

  const view = { boot: null, replicas: new Map(), current: null, selected: null, numHellos: 0,
                 connection: "connecting", hues: new Map() };

  function newReplica(name) {
    return { name, info: {}, state: "", steps: [], seats: new Map(), finished: new Map(),
             recent: new Map(), whyWaiting: null };
  }

  function replica(name) {
    if (!view.replicas.has(name)) {
      view.replicas.set(name, newReplica(name));
      const option = document.createElement("option");
      option.value = option.textContent = name;
      $("replica").appendChild(option);
      if (view.current === null) view.current = name;
    }
    return view.replicas.get(name);
  }

  // ---- colours: one per request, spread by the golden angle in order of appearance ----------------
  function hueOf(id) {
    const parent = id.split("#")[0]; // the n samples of a request share its colour
    if (!view.hues.has(parent)) view.hues.set(parent, (view.hues.size * 137.508) % 360);
    return view.hues.get(parent);
  }

  function cellColor(cell) {
    if (cell.kind === "x") return SEGMENT_COLORS.padding;
    const hue = hueOf(cell.id);
    return cell.kind === "p" ? `hsl(${hue}, 70%, 36%)` : `hsl(${hue}, 62%, 60%)`;
  }

  // ---- events ------------------------------------------------------------------------------------
  function onHello(event) {
    const hello = JSON.parse(event.data);
    view.numHellos += 1;
    if (hello.boot !== view.boot) { // another server process: start over
      view.boot = hello.boot;
      view.replicas.clear();
      view.current = null;
      $("replica").textContent = "";
    }
    for (const info of hello.replicas) replica(info.replica).info = info;
    setEngineState(hello.state);
  }

  function onTick(event) {
    const tick = JSON.parse(event.data);
    const r = replica(tick.replica);
    r.state = tick.state;
    r.whyWaiting = tick.why_waiting;
    for (const step of tick.steps) {
      const last = r.steps[r.steps.length - 1];
      if (!last || step.step > last.step) addStep(r, step, tick.ids);
    }
    for (const f of tick.finished) {
      const id = tick.ids[f.id];
      r.finished.set(id, f);
      touch(r, id);
    }
    trimMap(r.finished, 4 * MAX_RECENT);
    if (tick.replica === view.current) setEngineState(tick.state);
    scheduleDraw();
  }

  // Seats as the metro has them: a request keeps its lane while it rides; a newcomer takes the lowest free one.
  function addStep(r, step, ids) {
    const rowIds = step.rows.map((i) => ids[i]);
    const present = new Set(rowIds);
    for (const id of [...r.seats.keys()]) if (!present.has(id)) r.seats.delete(id);
    const used = new Set(r.seats.values());
    const cells = [];
    rowIds.forEach((id, row) => {
      let lane = r.seats.get(id);
      if (lane === undefined) {
        lane = 0;
        while (used.has(lane)) lane += 1;
        used.add(lane);
        r.seats.set(id, lane);
      }
      cells[lane] = { id, kind: step.kinds[row] || "d", tokens: step.tokens[row] ?? 1 };
      touch(r, id);
    });
    step.cells = cells;
    delete step.rows;
    r.steps.push(step);
    if (r.steps.length > WINDOW) r.steps.shift();
  }

  function touch(r, id) { // most recently seen last
    r.recent.delete(id);
    r.recent.set(id, true);
    trimMap(r.recent, MAX_RECENT);
  }

  function trimMap(map, size) {
    while (map.size > size) map.delete(map.keys().next().value);
  }

  // ---- connection: EventSource reconnects by itself; a closed one is reopened --------------------
  function connect() {
    const source = new EventSource("/dashboard/events");
    source.addEventListener("hello", onHello);
    source.addEventListener("tick", onTick);
    source.onopen = () => setConnection("live");
    source.onerror = () => {
      setConnection("reconnecting");
      if (source.readyState === EventSource.CLOSED) setTimeout(connect, 1000);
    };
  }

  function setConnection(status) {
    view.connection = status;
    const badge = $("conn");
    badge.className = `badge conn ${status}`;
    badge.textContent = status === "live" ? "live" : "reconnecting…";
  }

  function setEngineState(state) { $("engine-state").textContent = `engine ${state}`; }

  // ---- drawing -------------------------------------------------------------------------------------
  let drawPending = false;
  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => { drawPending = false; draw(); });
  }

  function draw() {
    const r = view.replicas.get(view.current);
    if (!r) return;
    drawTiles(r);
    drawMetro(r);
    drawStepTime(r);
    drawQueues(r);
    drawRecent(r);
  }

  function sizeCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height };
  }

  function metroGeometry(r, width, height) {
    const numLanes = Math.max(1, r.info.max_num_seqs && r.info.max_num_seqs <= 64
      ? r.info.max_num_seqs : 0, ...r.steps.map((s) => s.cells.length));
    return { cellWidth: width / WINDOW, laneHeight: height / numLanes, numLanes,
             offset: WINDOW - r.steps.length };
  }

  function drawMetro(r) {
    const { ctx, width, height } = sizeCanvas($("metro"));
    const g = metroGeometry(r, width, height);
    for (let lane = 0; lane < g.numLanes; lane += 1) { // idle rows: the background
      ctx.fillStyle = lane % 2 ? "#eceff3" : "#f3f5f8";
      ctx.fillRect(0, lane * g.laneHeight, width, g.laneHeight);
    }
    const lastCell = new Map();
    r.steps.forEach((step, i) => {
      const x = (g.offset + i) * g.cellWidth;
      step.cells.forEach((cell, lane) => {
        if (!cell) return;
        drawCell(ctx, cell, x, lane * g.laneHeight, g);
        lastCell.set(cell.id, [x, lane]);
      });
    });
    drawFinishMarks(ctx, r, lastCell, g);
  }

  function drawCell(ctx, cell, x, y, g) {
    const w = Math.max(g.cellWidth - 0.3, 0.8), h = Math.max(g.laneHeight - 1, 1);
    ctx.globalAlpha = view.selected && cell.id !== view.selected ? 0.45 : 1; // the selected one stands out
    ctx.fillStyle = cellColor(cell);
    ctx.fillRect(x, y + 0.5, w, h);
    if (cell.kind === "x") { // padding: a throw-away row, hatched
      ctx.fillStyle = "rgba(255,255,255,0.55)";
      ctx.fillRect(x, y + 0.5, w / 2, h);
    }
    ctx.globalAlpha = 1;
  }

  function drawFinishMarks(ctx, r, lastCell, g) {
    ctx.fillStyle = "#1d2330";
    for (const [id, [x, lane]] of lastCell) {
      if (!r.finished.has(id)) continue;
      ctx.fillRect(x + g.cellWidth - 2, lane * g.laneHeight, 2, g.laneHeight);
    }
  }

  function drawSeries(ctx, r, width, height, series, maxValue) {
    const cellWidth = width / WINDOW, offset = WINDOW - r.steps.length;
    for (const { key, color, dash } of series) {
      ctx.strokeStyle = color;
      ctx.setLineDash(dash || []);
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      r.steps.forEach((step, i) => {
        const value = step[key];
        if (key === "pred_ms" && !value) { started = false; return; } // the model is not fitted yet
        const y = height - (Math.min(value, maxValue) / maxValue) * (height - 4) - 2;
        const x = (offset + i + 0.5) * cellWidth;
        if (started) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        started = true;
      });
      ctx.stroke();
    }
    ctx.setLineDash([]);
  }

  function axisLabel(ctx, text) {
    ctx.fillStyle = "#6b7280";
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillText(text, 4, 12);
  }

  function drawStepTime(r) {
    const { ctx, width, height } = sizeCanvas($("steptime"));
    // The scale follows the measured steps: an early, unfitted prediction must not flatten them.
    const measured = r.steps.map((s) => s.ms).sort((a, b) => a - b);
    const typical = measured[Math.floor(measured.length * 0.98)] || 1;
    const maxMs = Math.max(1, Math.min(Math.max(...r.steps.map((s) => Math.max(s.ms, s.pred_ms))),
                                       typical * 1.6)) * 1.1;
    drawSeries(ctx, r, width, height, [{ key: "ms", color: "#1c7ed6" },
      { key: "pred_ms", color: "#f59f00", dash: [4, 3] }], maxMs);
    axisLabel(ctx, `${maxMs.toFixed(1)} ms`);
  }

  function drawQueues(r) {
    const { ctx, width, height } = sizeCanvas($("queues"));
    const cellWidth = width / WINDOW, offset = WINDOW - r.steps.length;
    ctx.fillStyle = "rgba(173,181,189,0.35)"; // KV usage as an area, 0..100 %
    r.steps.forEach((step, i) => {
      const h = step.kv * (height - 4);
      ctx.fillRect((offset + i) * cellWidth, height - h, cellWidth + 0.5, h);
    });
    const maxCount = Math.max(1, ...r.steps.map((s) => Math.max(s.running, s.waiting, s.swapped))) * 1.1;
    drawSeries(ctx, r, width, height, [{ key: "running", color: "#2f9e44" },
      { key: "waiting", color: "#e8590c" }, { key: "swapped", color: "#7048e8" }], maxCount);
    axisLabel(ctx, `${Math.round(maxCount)} requests · KV 100 %`);
  }

  // ---- tiles -----------------------------------------------------------------------------------------
  function rates(steps) {
    const last = steps[steps.length - 1];
    const end = last.t + last.ms / 1e3;
    let generated = 0, prefilled = 0, start = end;
    for (let i = steps.length - 1; i >= 0 && end - steps[i].t <= RATE_WINDOW_S; i -= 1) {
      generated += steps[i].gen;
      prefilled += steps[i].prefill;
      start = steps[i].t;
    }
    const span = Math.max(end - start, 1e-3);
    return { tokens: generated / span, prefill: prefilled / span };
  }

  function whyText(why) { // the newest step's sequences without a row, by reason
    if (!why) return "why: –";
    const counts = Object.entries(why.counts).sort((a, b) => b[1] - a[1]);
    return counts.length ? `why: ${counts.map(([reason, n]) => `${reason} ${n}`).join(", ")}` : "why: nobody waits";
  }

  function reasonList(waitSteps) {
    return Object.entries(waitSteps || {}).sort((a, b) => b[1] - a[1])
      .map(([reason, n]) => `${escapeHtml(reason)} (${n} step${n === 1 ? "" : "s"})`).join(", ");
  }

  function mean(values) { return values.length ? values.reduce((a, b) => a + b, 0) / values.length : 0; }

  function drawTiles(r) {
    const last = r.steps[r.steps.length - 1];
    if (!last) return;
    const recent = r.steps.slice(-20);
    const { tokens, prefill } = rates(r.steps);
    const predicted = mean(recent.map((s) => s.pred_ms));
    $("t-running").textContent = last.running;
    $("t-waiting").textContent = last.waiting;
    $("t-why").textContent = whyText(r.whyWaiting);
    $("t-swapped").textContent = last.swapped;
    $("t-kv").textContent = `${(last.kv * 100).toFixed(1)} %`;
    $("t-hit").textContent = `${(last.hit * 100).toFixed(1)} %`;
    $("t-tps").textContent = tokens.toFixed(0);
    $("t-pps").textContent = prefill.toFixed(0);
    $("t-step").textContent = `${mean(recent.map((s) => s.ms)).toFixed(1)} · ${predicted ? predicted.toFixed(1) : "–"}`;
    $("t-pre").textContent = r.steps.reduce((n, s) => n + s.preempted, 0);
    $("t-last").textContent = last.step;
    $("window-size").textContent = WINDOW;
  }

  function drawRecent(r) {
    const list = $("requests");
    list.textContent = "";
    for (const id of [...r.recent.keys()].reverse()) {
      const item = document.createElement("li");
      item.dataset.requestId = id;
      if (id === view.selected) item.className = "selected";
      const finished = r.finished.get(id);
      item.innerHTML = `<i class="sw" style="background:hsl(${hueOf(id)},62%,60%)"></i>`;
      item.append(span("id", id), span("status", finished ? finished.reason : "live"));
      item.onclick = () => select(id);
      list.appendChild(item);
    }
  }

  function span(className, text) {
    const element = document.createElement("span");
    element.className = className;
    element.textContent = text;
    return element;
  }

  // ---- click: a request's timeline -----------------------------------------------------------------
  function cellAt(r, clientX, clientY) {
    const canvas = $("metro"), box = canvas.getBoundingClientRect();
    const g = metroGeometry(r, canvas.clientWidth, canvas.clientHeight);
    const step = r.steps[Math.floor((clientX - box.left) / g.cellWidth) - g.offset];
    return step ? step.cells[Math.floor((clientY - box.top) / g.laneHeight)] : undefined;
  }

  function locate(id) { // canvas coordinates of the request's newest cell (for tests and tooltips)
    const r = view.replicas.get(view.current), canvas = $("metro");
    if (!r) return null;
    const g = metroGeometry(r, canvas.clientWidth, canvas.clientHeight);
    for (let i = r.steps.length - 1; i >= 0; i -= 1) {
      const lane = r.steps[i].cells.findIndex((c) => c && c.id === id);
      if (lane >= 0) return { x: (g.offset + i + 0.5) * g.cellWidth, y: (lane + 0.5) * g.laneHeight };
    }
    return null;
  }

  async function select(id) {
    view.selected = id;
    scheduleDraw();
    const parent = id.split("#")[0];
    const response = await fetch(`/dashboard/requests/${encodeURIComponent(parent)}`);
    if (view.selected !== id) return;
    if (!response.ok) {
      showDetail(`<p class="muted">${escapeHtml(parent)}: no longer in the recent steps.</p>`);
      return;
    }
    showDetail(renderTimeline(await response.json()));
  }

  function showDetail(html) {
    $("detail-empty").hidden = true;
    $("detail-body").innerHTML = html;
  }

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  }

  function renderTimeline(timeline) {
    const header = `<p><b class="mono">${escapeHtml(timeline.request_id)}</b> on ${escapeHtml(timeline.replica)}</p>`;
    return header + timeline.sequences.map(renderSequence).join("");
  }

  function renderSequence(seq) {
    const status = seq.status === "finished" ? `finished: <b>${escapeHtml(seq.finish_reason)}</b>` : "live";
    const truncated = seq.is_truncated ? `<p class="why">Older steps have left the kept window.</p>` : "";
    const error = seq.error ? `<p class="why">error: ${escapeHtml(seq.error)}</p>` : "";
    return `<div class="seq" data-seq-id="${escapeHtml(seq.id)}"><h4>${escapeHtml(seq.id)} · ${status}</h4>` +
      renderMetrics(seq.metrics) + renderBar(seq.segments) + truncated + error +
      renderSegments(seq.segments) + renderWhy(seq.segments) + "</div>";
  }

  function formatMs(value) {
    if (value === null || value === undefined) return "–";
    return value >= 10000 ? `${(value / 1e3).toFixed(1)} s` : `${value.toFixed(1)} ms`;
  }

  function renderMetrics(m) {
    if (!m) return `<p class="why">Arrival, queue time and TTFT appear when it finishes.</p>`;
    const ms = formatMs;
    const rows = [["queue (to first scheduled)", ms(m.first_scheduled_ms)], ["time to first token", ms(m.first_token_ms)],
      ["end to end", ms(m.finished_ms)], ["prompt tokens (cached)", `${m.num_prompt_tokens} (${m.num_cached_tokens})`],
      ["output tokens", m.num_output_tokens], ["preemptions · swaps", `${m.num_preemptions} · ${m.num_swaps}`],
      ["recomputed tokens", m.num_recomputed_tokens],
      ["steps without a row", reasonList(m.wait_steps) || "none"]];
    return `<dl class="metrics">${rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("")}</dl>`;
  }

  function segmentColor(segment, hue) {
    if (segment.kind === "prefill") return `hsl(${hue}, 70%, 36%)`;
    if (segment.kind === "decode") return `hsl(${hue}, 62%, 60%)`;
    return SEGMENT_COLORS[segment.kind] || "#ccc";
  }

  function renderBar(segments) {
    if (!segments.length) return "";
    const start = segments[0].start_ms, end = Math.max(...segments.map((s) => s.end_ms));
    const span = Math.max(end - start, 1e-3), hue = view.selected ? hueOf(view.selected) : 200;
    const rects = segments.map((s) => {
      const x = ((s.start_ms - start) / span) * 100, w = Math.max(((s.end_ms - s.start_ms) / span) * 100, 0.3);
      return `<rect x="${x}%" y="4" width="${w}%" height="26" fill="${segmentColor(s, hue)}"><title>${s.kind}</title></rect>`;
    }).join("");
    return `<svg class="timeline">${rects}</svg><div class="axis"><span>${formatMs(start)}</span><span>${formatMs(end)}</span></div>`;
  }

  function renderSegments(segments) {
    const rows = segments.map((s) => {
      const steps = s.first_step === undefined ? "" : s.first_step === s.last_step ? s.first_step : `${s.first_step}–${s.last_step}`;
      const kind = s.kind === "unscheduled" ? "no row (preempted or held)" : s.is_recompute ? "prefill (recompute)" : s.kind;
      const why = s.preemption ? `preempted: ${s.preemption.mode}` : (s.wait_reason || "");
      return `<tr class="segment ${s.kind}"><td>${kind}</td><td>${steps}</td><td>${s.num_tokens || ""}</td>` +
        `<td>${escapeHtml(why)}</td><td>${formatMs(s.end_ms - s.start_ms)}</td></tr>`;
    }).join("");
    return `<table class="segments"><tr><th>what</th><th>steps</th><th>tokens</th><th>why</th><th>for</th></tr>${rows}</table>`;
  }

  function renderWhy(segments) { // each wait and gap: its steps by reason, and the preemption that began it
    const lines = segments.filter((s) => s.wait_steps && Object.keys(s.wait_steps).length).map((s) => {
      const what = s.kind === "waiting" ? "waiting" : `no row from step ${s.first_step}`;
      return `${what}: ${reasonList(s.wait_steps)}${preemptionText(s.preemption)}`;
    });
    return lines.length ? `<p class="why">Why it waited: ${lines.join("; ")}.</p>` : "";
  }

  function preemptionText(p) {
    if (!p) return "";
    const costs = p.recompute_ms !== null || p.swap_ms !== null
      ? `, predicted recompute ${formatMs(p.recompute_ms)} vs swap ${formatMs(p.swap_ms)}` : "";
    return ` (preempted by ${escapeHtml(p.mode)}: ${escapeHtml(p.why)}, ${p.num_computed_tokens} tokens of KV${costs})`;
  }

  // ---- wiring ----------------------------------------------------------------------------------------
  $("metro").addEventListener("click", (event) => {
    const r = view.replicas.get(view.current);
    const cell = r && cellAt(r, event.clientX, event.clientY);
    if (cell) select(cell.id);
  });
  $("metro").addEventListener("mousemove", (event) => {
    const r = view.replicas.get(view.current);
    const cell = r && cellAt(r, event.clientX, event.clientY);
    $("metro").title = cell ? `${cell.id} · ${KIND_NAMES[cell.kind]} · ${cell.tokens} tokens` : "";
  });
  $("replica").addEventListener("change", (event) => { view.current = event.target.value; scheduleDraw(); });
  window.addEventListener("resize", scheduleDraw);
  window.cobatchDashboard = { view, locate, select };
  connect();
})();
