"""The run report's agent trace viewer: the agent episodes kept in samples.jsonl, turn by turn.

Each sample row of an agent run carries a `trace` (rlhfkit.agents.trace): the prompt the model saw, then per turn the
text it sampled (action mask 1: these tokens train), the tool calls its environment ran with their arguments and
results, the feedback appended after the turn (mask 0: context only) and the turn's reward; and per episode the
reward it trained with, how it finished (done, turns, budget = truncated, failed) and why it failed. The page embeds
the traces as JSON and builds the view with inline JavaScript (text only through `textContent`, so nothing in a
trace is read as HTML); filters by reward range, by step, and to failed or truncated episodes. The filters can be
preset from the page address: `report.html#trace-min=0.5&trace-step=10&trace-problems=1`.
"""

from __future__ import annotations

import json
from typing import Any


def traced(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sample rows that carry an agent trace."""
    return [r for r in rows if isinstance(r.get("trace"), dict)]


def traces_html(rows: list[dict[str, Any]]) -> str:
    """The viewer's section for `rows` (sample rows with a trace); nothing when there are none."""
    rows = traced(rows)
    if not rows:
        return ""
    data = json.dumps([{"step": r.get("step", 0), "reward": r.get("reward"), "trace": r["trace"]} for r in rows],
                      default=str).replace("</", "<\\/")  # "</" cannot appear inside a <script> element
    steps = sorted({int(r.get("step", 0)) for r in rows})
    options = "".join(f"<option value='{s}'>{s}</option>" for s in steps)
    return _SECTION.format(options=options, data=data, script=_SCRIPT)


_SECTION = """<h2>Agent traces</h2>
<style>
#traces details.episode {{ border: 1px solid #ddd; border-radius: 6px; margin: 6px 0; padding: 4px 8px; }}
#traces summary {{ cursor: pointer; font-size: 13px; }}
#traces details.prompt summary {{ font-size: 12px; color: #555; }}
#trace-filter input[type=number] {{ width: 6em; }}
#traces .bad {{ color: #b00; }}
#traces pre.seg {{ margin: 2px 0; padding: 4px; white-space: pre-wrap; font-size: 12px; max-width: 1100px;
                   border-left: 4px solid; }}
#traces pre.ctx {{ background: #f4f4f4; border-color: #999; }}
#traces pre.act {{ background: #eaf6ea; border-color: #2ca02c; }}
#traces pre.fb {{ background: #f0f0f7; border-color: #7f7fbf; }}
#traces .turn {{ margin: 6px 0 10px 0; }}
#traces .turn-head {{ font-size: 12px; color: #555; }}
#traces .maskbar {{ display: flex; height: 10px; width: 600px; margin: 4px 0; border: 1px solid #ccc; }}
#traces .maskbar span.act {{ background: #2ca02c; }}
#traces .maskbar span.fb {{ background: #b8b8dc; }}
#traces table.calls {{ margin: 2px 0 2px 12px; }}
#traces table.calls pre {{ margin: 0; white-space: pre-wrap; max-width: 520px; }}
</style>
<p id="trace-filter">reward from <input id="trace-min" type="number" step="any"> to
<input id="trace-max" type="number" step="any">; step <select id="trace-step"><option value="">all</option>
{options}</select>; <label><input type="checkbox" id="trace-problems"> failed or truncated only</label>
<span id="trace-count"></span><br><small>Green: tokens the policy sampled (action mask 1, trained); blue-grey:
feedback appended by the environment (mask 0, not trained); grey: the prompt.</small></p>
<div id="traces"></div>
<script id="trace-data" type="application/json">{data}</script>
<script>{script}</script>
"""

_SCRIPT = r"""
(function () {
  var rows = JSON.parse(document.getElementById("trace-data").textContent);
  var box = document.getElementById("traces");
  function node(tag, cls, text, parent) {
    var n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined && text !== null) n.textContent = text;
    if (parent) parent.appendChild(n);
    return n;
  }
  function fmt(v) {
    return v === null || v === undefined ? "-" : (typeof v === "number" ? +v.toPrecision(4) + "" : String(v));
  }
  function segment(parent, kind, text, tokens, what) {
    var pre = node("pre", "seg " + kind, text, parent);
    pre.setAttribute("data-tokens", tokens);
    pre.title = what + ": " + tokens + " tokens";
  }
  function maskBar(parent, turns) {
    var bar = node("div", "maskbar", null, parent);
    bar.title = "the response's tokens in order: green trains (mask 1), blue-grey does not (mask 0)";
    turns.forEach(function (t) {
      [["act", t.action_tokens], ["fb", t.feedback_tokens]].forEach(function (part) {
        if (part[1] > 0) node("span", part[0], null, bar).style.flexGrow = part[1];
      });
    });
  }
  function calls(parent, list) {
    if (!list.length) return;
    var table = node("table", "calls", null, parent);
    var head = node("tr", null, null, table);
    ["tool", "arguments", "result"].forEach(function (h) { node("th", null, h, head); });
    list.forEach(function (c) {
      var tr = node("tr", "tool-call" + (c.ok ? "" : " bad"), null, table);
      var args = c.arguments === null || c.arguments === undefined ? "" :
                 (typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments));
      tr.setAttribute("data-name", c.name === null ? "" : c.name);
      tr.setAttribute("data-arguments", args);
      tr.setAttribute("data-result", c.result);
      tr.setAttribute("data-ok", c.ok ? "1" : "0");
      node("td", null, c.name === null ? "(malformed call)" : c.name, tr);
      node("pre", null, args, node("td", null, null, tr));
      node("pre", null, c.result, node("td", null, null, tr));
    });
  }
  function turn(parent, t, k, last, trace) {
    var div = node("div", "turn", null, parent);
    var head = "turn " + (k + 1) + " \u00b7 reward " + fmt(t.reward) + " \u00b7 " + t.action_tokens +
               " sampled tokens (trained) \u00b7 " + t.feedback_tokens + " feedback tokens (not trained)";
    var failedHere = last && trace.finish === "failed" && t.reward === null;
    node("div", "turn-head" + (failedHere ? " bad" : ""), head + (failedHere ? " \u00b7 failed here" : ""), div);
    segment(div, "act", t.action, t.action_tokens, "sampled, trained (action mask 1)");
    calls(div, t.tool_calls);
    if (t.feedback_tokens > 0) segment(div, "fb", t.feedback, t.feedback_tokens, "feedback, not trained (mask 0)");
  }
  function episode(row, i) {
    var t = row.trace, n = 0;
    t.turns.forEach(function (u) { n += u.tool_calls.length; });
    var problem = t.finish === "failed" || t.truncated;
    var d = node("details", "episode", null, box);
    d.setAttribute("data-step", row.step);
    d.setAttribute("data-reward", row.reward === null ? "" : row.reward);
    d.setAttribute("data-problem", problem ? "1" : "0");
    var text = "step " + row.step + " \u00b7 episode " + (i + 1) + " \u00b7 reward " + fmt(row.reward) +
               " \u00b7 " + t.finish + (t.truncated ? " (truncated)" : "") + " \u00b7 " + t.turns.length +
               " turns \u00b7 " + n + " tool calls \u00b7 " + t.trained_tokens + " trained / " + t.feedback_tokens +
               " feedback tokens";
    node("summary", problem ? "bad" : null, text, d);
    if (t.error) node("div", "bad", "failed: " + t.error, d);
    maskBar(d, t.turns);
    var prompt = node("details", "prompt", null, d);  // often long (a chat template with tool schemas): folded
    node("summary", null, "prompt \u00b7 " + t.prompt_tokens + " tokens (not trained)", prompt);
    segment(prompt, "ctx", t.prompt, t.prompt_tokens, "prompt, not trained");
    t.turns.forEach(function (u, k) { turn(d, u, k, k === t.turns.length - 1, t); });
    return d;
  }
  var perStep = {};  // episodes are numbered within their step
  var items = rows.map(function (row) {
    perStep[row.step] = (perStep[row.step] || 0) + 1;
    return [row, episode(row, perStep[row.step] - 1)];
  });
  var lo = document.getElementById("trace-min"), hi = document.getElementById("trace-max");
  var step = document.getElementById("trace-step"), problems = document.getElementById("trace-problems");
  function apply() {
    var shown = 0, a = parseFloat(lo.value), b = parseFloat(hi.value);
    items.forEach(function (item) {
      var r = item[0].reward, ok = true;
      if (!isNaN(a) && !(r >= a)) ok = false;
      if (!isNaN(b) && !(r <= b)) ok = false;
      if (step.value !== "" && String(item[0].step) !== step.value) ok = false;
      if (problems.checked && item[1].getAttribute("data-problem") !== "1") ok = false;
      item[1].style.display = ok ? "" : "none";
      item[1].setAttribute("data-shown", ok ? "1" : "0");
      shown += ok ? 1 : 0;
    });
    document.getElementById("trace-count").textContent = " (" + shown + " of " + items.length + " episodes shown)";
  }
  location.hash.replace(/^#/, "").split("&").forEach(function (part) {
    var kv = part.split("="), value = decodeURIComponent(kv[1] || "");
    if (kv[0] === "trace-min") lo.value = value;
    if (kv[0] === "trace-max") hi.value = value;
    if (kv[0] === "trace-step") step.value = value;
    if (kv[0] === "trace-problems") problems.checked = value === "1";
  });
  [lo, hi, step, problems].forEach(function (input) { input.addEventListener("input", apply);
                                                      input.addEventListener("change", apply); });
  apply();
  var first = items.filter(function (item) { return item[1].getAttribute("data-shown") === "1"; })[0];
  if (first) first[1].open = true;
  box.setAttribute("data-rendered", String(items.length));
})();
"""
