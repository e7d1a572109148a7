"""The run report: Markdown with SVG line charts drawn from `metrics.jsonl` (no plotting library needed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def read_metric(path: str | Path, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric from a JSONL metrics file, as the latest run left them.

    Trainers append to `metrics.jsonl`, so a file may hold several runs: a step at or below the previous one
    starts a new run, whose records replace those from that step on (a fresh run from step 1 replaces everything;
    a run resumed at step k keeps the earlier run's steps below k)."""
    points: list[tuple[int, float]] = []
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if key in record:
            step = int(record["step"])
            while points and points[-1][0] >= step:
                points.pop()
            points.append((step, float(record[key])))
    return points


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the report shows noisy RL curves)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def svg_line_chart(points: Sequence[tuple[int, float]], title: str, width: int = 480, height: int = 220,
                   smooth_window: int = 1) -> str:
    """A self-contained SVG line chart of (step, value) points, with min/max labels."""
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="8" y="24">' \
               f'{title}: no data</text></svg>'
    steps = [p[0] for p in points]
    values = smooth([p[1] for p in points], smooth_window)
    left, right, top, bottom = 56, 12, 28, 28
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def x(s: float) -> float:
        return left + (s - x0) / max(x1 - x0, 1) * (width - left - right)

    def y(v: float) -> float:
        return top + (y1 - v) / (y1 - y0) * (height - top - bottom)

    path = " ".join(f"{'M' if i == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for i, (s, v) in enumerate(zip(steps, values)))
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="16" font-size="13">{title}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
        f'<text x="4" y="{y(y1) + 4:.1f}">{y1:.3g}</text>',
        f'<text x="4" y="{y(y0) + 4:.1f}">{y0:.3g}</text>',
        f'<text x="{left}" y="{height - 8}">step {x0}</text>',
        f'<text x="{width - right - 60}" y="{height - 8}">step {x1}</text>',
        f'<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>',
        "</svg>",
    ])


def write_chart(metrics_path: str | Path, key: str, out_path: str | Path, title: str,
                smooth_window: int = 1) -> Path:
    out = Path(out_path)
    out.write_text(svg_line_chart(read_metric(metrics_path, key), title, smooth_window=smooth_window))
    return out


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """A one-line text chart for the console, resampled to `width` characters."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    step = max(len(values) / width, 1)
    sampled = [values[min(int(i * step), len(values) - 1)] for i in range(min(width, len(values)))]
    lo, hi = min(sampled), max(sampled)
    span = hi - lo or 1.0
    return "".join(bars[min(int((v - lo) / span * (len(bars) - 1)), len(bars) - 1)] for v in sampled)
