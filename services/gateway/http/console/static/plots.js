"use strict";
// Small SVG line plots over a rolling window of the last minutes: no library, no canvas.
// Every text goes in through textContent (series names can be version labels).

const PLOT_COLORS = ["#2f6fde", "#d9822b", "#1f8a4c", "#9b59b6", "#c8372d", "#16a2b8"];
const PLOT_WINDOW_S = 300; // the last five minutes
const PLOT_MIN_SPAN_S = 30;
const SVG_NS = "http://www.w3.org/2000/svg";

function svgElement(name, attrs) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  return el;
}

class LinePlot {
  // max: a fixed top of the y axis (1 for a fraction), else the data's own; format: y labels
  constructor(container, { max = null, format = (v) => v.toFixed(2) } = {}) {
    this.container = container;
    this.series = new Map(); // name -> [[t, value], ...], oldest first
    this.max = max;
    this.format = format;
  }

  push(name, t, value) {
    if (value === null || value === undefined || !Number.isFinite(value)) return;
    let points = this.series.get(name);
    if (!points) {
      points = [];
      this.series.set(name, points);
    }
    points.push([t, value]);
    while (points.length && points[0][0] < t - PLOT_WINDOW_S) points.shift();
  }

  top() {
    if (this.max !== null) return this.max;
    let top = 0;
    for (const points of this.series.values()) for (const [, v] of points) top = Math.max(top, v);
    return top > 0 ? top * 1.1 : 1;
  }

  render(now) {
    const width = this.container.clientWidth || 300;
    const height = 110;
    const left = 40;
    const bottom = 14;
    const top = this.top();
    // the x axis spans the readings held (at least PLOT_MIN_SPAN_S, at most the window)
    let oldest = now;
    for (const points of this.series.values()) {
      if (points.length) oldest = Math.min(oldest, points[0][0]);
    }
    const span = Math.min(PLOT_WINDOW_S, Math.max(PLOT_MIN_SPAN_S, now - oldest));
    const x = (t) => left + ((width - left - 4) * (t - (now - span))) / span;
    const y = (v) => height - bottom - ((height - bottom - 6) * v) / top;
    const svg = svgElement("svg", { class: "plot", viewBox: `0 0 ${width} ${height}` });
    svg.append(svgElement("line", { class: "axis", x1: left, y1: y(0), x2: width, y2: y(0) }));
    svg.append(svgElement("line", { class: "axis", x1: left, y1: y(top), x2: width, y2: y(top) }));
    for (const [v, label] of [[0, this.format(0)], [top, this.format(top)]]) {
      const text = svgElement("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" });
      text.textContent = label;
      svg.append(text);
    }
    const minutes = svgElement("text", { x: left, y: height - 2 });
    minutes.textContent = span >= 120 ? `-${(span / 60).toFixed(0)} min` : `-${span.toFixed(0)} s`;
    const nowLabel = svgElement("text", { x: width - 4, y: height - 2, "text-anchor": "end" });
    nowLabel.textContent = "now";
    svg.append(minutes, nowLabel);
    const legend = document.createElement("div");
    legend.className = "legend";
    let i = 0;
    for (const [name, points] of this.series) {
      const color = PLOT_COLORS[i++ % PLOT_COLORS.length];
      const path = points.map(([t, v], j) => `${j ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      if (path.length) {
        svg.append(svgElement("path", { d: path.join(""), fill: "none", stroke: color,
          "stroke-width": 1.5 }));
      }
      const key = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      const last = points.length ? this.format(points[points.length - 1][1]) : "–";
      key.append(swatch, `${name}: ${last}`);
      legend.append(key);
    }
    this.container.replaceChildren(svg, legend);
    // how many readings the longest series holds (what a test waits for)
    const counts = [...this.series.values()].map((points) => points.length);
    this.container.dataset.points = String(Math.max(0, ...counts));
  }
}

// The console's five plots, fed one snapshot at a time (rates from two readings' difference).
class Plots {
  constructor() {
    const pct = (v) => `${(v * 100).toFixed(0)}%`;
    this.kv = new LinePlot(document.getElementById("plot-kv"), { max: 1, format: pct });
    this.prefix = new LinePlot(document.getElementById("plot-prefix"), { max: 1, format: pct });
    this.queues = new LinePlot(document.getElementById("plot-queues"),
      { format: (v) => v.toFixed(0) });
    this.throughput = new LinePlot(document.getElementById("plot-throughput"),
      { format: (v) => v.toFixed(0) });
    this.latency = new LinePlot(document.getElementById("plot-latency"),
      { format: (v) => v.toFixed(2) });
    this.previous = null;
  }

  // prefill/decode replicas: TTFT's parts per handed-over sequence (the prefill queue, the
  // prefill, the transfer of its blocks) and the KV bytes moved per second
  addHandover(stats, was, t, dt) {
    const delta = (key) => (stats[key] || 0) - (was[key] || 0);
    const handed = delta("kv_handover_num_handed_over");
    if (handed > 0) {
      this.latency.push("prefill queue", t, delta("kv_handover_prefill_queue_s") / handed);
      this.latency.push("prefill", t, delta("kv_handover_prefill_s") / handed);
    }
    const received = delta("kv_handover_num_received");
    if (received > 0) this.latency.push("KV transfer", t, delta("kv_handover_transfer_s") / received);
    if (stats.kv_handover_bytes_received !== undefined) {
      this.throughput.push("KV moved (KiB/s)", t, delta("kv_handover_bytes_received") / 1024 / dt);
    }
  }

  add(snapshot) {
    const t = snapshot.t;
    const stats = snapshot.stats || {};
    const replicas = stats.replicas || [stats];
    for (const [i, replica] of replicas.entries()) {
      if (!replica.ready) continue;
      const version = replica.version || snapshot.model.version || "?";
      const name = replicas.length > 1 ? `replica ${i} · ${version}` : version;
      this.kv.push(name, t, replica.kv_cache_usage);
    }
    if (stats.ready !== false) {
      this.queues.push("running", t, stats.num_running);
      this.queues.push("waiting", t, stats.num_waiting);
      this.queues.push("swapped", t, stats.num_swapped);
    }
    // prefill/decode replicas: the queue depths of each role
    const withRoles = replicas.filter((r) => r.ready && r.role);
    for (const role of withRoles.length ? ["prefill", "decode"] : []) {
      const mine = withRoles.filter((r) => r.role === role);
      const sum = (key) => mine.reduce((total, r) => total + (r[key] || 0), 0);
      this.queues.push(`${role} waiting`, t, sum("num_waiting"));
      this.queues.push(`${role} running`, t, sum("num_running"));
    }
    const before = this.previous;
    if (before && t > before.t) {
      const totals = snapshot.totals;
      const was = before.totals;
      const dt = t - before.t;
      this.throughput.push("output", t, (totals.num_output_tokens - was.num_output_tokens) / dt);
      const started = totals.num_with_first_token - was.num_with_first_token;
      if (started > 0) this.latency.push("TTFT", t, (totals.ttft_sum_s - was.ttft_sum_s) / started);
      const ended = totals.num_finished - was.num_finished;
      if (ended > 0) this.latency.push("end-to-end", t, (totals.e2e_sum_s - was.e2e_sum_s) / ended);
      const queries = (stats.prefix_cache_queries || 0) - (before.stats.prefix_cache_queries || 0);
      const hits = (stats.prefix_cache_hits || 0) - (before.stats.prefix_cache_hits || 0);
      if (queries > 0) this.prefix.push("hits / queried tokens", t, hits / queries);
      this.addHandover(stats, before.stats, t, dt);
    }
    if (stats.ready !== false) this.previous = snapshot;
    for (const plot of [this.kv, this.prefix, this.queues, this.throughput, this.latency]) {
      plot.render(t);
    }
  }
}
