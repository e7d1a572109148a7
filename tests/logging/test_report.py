"""Report charts and metric files."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from rlhfkit.logging.report import read_metric, smooth, sparkline, svg_line_chart, write_chart


def test_read_metric_and_chart(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps({"step": s, "train/reward": s / 10}) for s in range(1, 6)) + "\n"
                    + json.dumps({"step": 5, "eval/loss": 1.0}) + "\n")
    assert read_metric(path, "train/reward") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5)]
    svg = write_chart(path, "train/reward", tmp_path / "r.svg", "reward").read_text()
    root = ET.fromstring(svg)  # well-formed XML
    d = [e for e in root.iter() if e.tag.endswith("path")][0].attrib["d"]
    assert d.count("L") == 4 and d.startswith("M56.0,")


def test_read_metric_keeps_the_latest_run(tmp_path):
    """A rerun into the same directory appends from step 1; a resumed run appends from its checkpoint's step."""
    def lines(steps, value):
        return "".join(json.dumps({"step": s, "train/reward": value}) + "\n" for s in steps)

    path = tmp_path / "m.jsonl"
    path.write_text(lines(range(1, 8), 0.0) + lines(range(6, 9), 1.0))  # stopped at 7, resumed from step 5
    assert read_metric(path, "train/reward") == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 0.0), (6, 1.0),
                                                 (7, 1.0), (8, 1.0)]
    path.write_text(lines(range(1, 8), 0.0) + lines(range(1, 4), 2.0))  # a fresh rerun
    assert read_metric(path, "train/reward") == [(1, 2.0), (2, 2.0), (3, 2.0)]


def test_smooth_is_a_trailing_mean():
    assert smooth([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]


def test_sparkline_rises():
    line = sparkline([0, 1, 2, 3, 4, 5, 6, 7])
    assert line == "▁▂▃▄▅▆▇█"


def test_empty_chart_says_no_data():
    assert "no data" in svg_line_chart([], "x")
