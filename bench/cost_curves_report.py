"""The pictures and tables of `bench/cost_curves.py`: bench/results/cost_curves.md (every point measured beside the
`--dry_run` estimate of `rlhfkit/planner/step_time.py`, and a fit of that module's constants on this run) and
bench/results/cost_curves_*.png, copied to docs/images/cost-curves/ for docs/cost-curves.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT
from cost_curves import GRPO_PROMPTS

from rlhfkit.planner import step_time as st
from rlhfkit.planner.cpu_probe import CpuProbe
from rlhfkit.planner.memory import ModelShape, read_model_shape

DOCS_IMAGES = ROOT / "docs" / "images" / "cost-curves"
WORKDIR = ROOT / "runs" / "bench"


def shapes(data: dict[str, Any], names: set[str]) -> dict[str, ModelShape]:
    """The models' shapes from the configs the run stored (or the models' directories in runs/bench)."""
    out = {}
    for name in names:
        config = data.get("models", {}).get(name)
        directory = WORKDIR / f"curves_{name}"
        if config:
            directory = WORKDIR / "curves_configs" / name
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "config.json").write_text(json.dumps(config))
        out[name] = read_model_shape(str(directory))
    return out


def probe_of(probes: dict[str, Any], kernel: str, threads: int) -> CpuProbe | None:
    """The run's probe of `kernel` at `threads` (`bench/cost_curves.py` records them; None in runs before them)."""
    found = probes.get(kernel, {}).get(str(threads))
    return CpuProbe(**found) if found else None


def predict(p: dict[str, Any], shape: ModelShape, probes: dict[str, Any]) -> st.StepTime:
    """The planner's estimate for one point (rows per rank = rows / world, every row full), with the rates scaled to
    the run's machine by its probes as `--dry_run` scales them (`step_time.describe`)."""
    fit = rates_of(p)
    rates = st.on_this_machine(fit, probe_of(probes, fit.kernel, 1))
    at_threads = probe_of(probes, fit.kernel, p["threads"])
    rows = p["rows"] // p["world"]
    work = st.offline_step_work(p["trainer"], shape, rows, p["max_len"], shape if p["trainer"] == "dpo" else None)
    tokens = rows * p["max_len"] * (1 if p["trainer"] == "sft" else 2)
    return st.cpu_step_time(work, tokens, p["threads"], rates, shape.params(), p["world"],
                            st.matmul_rate_from(fit, at_threads.gemm if at_threads else None))


def rates_of(p: dict[str, Any]) -> st.CpuRates:
    """The planner's rates for the kernel the point's linears ran on (points before the kernel was recorded: MKL)."""
    return st.cpu_rates(p.get("kernel", "aten") == "onednn")


def _terms(points: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([[p["work"].matmul, p["work"].attention, p["work"].elements, 1.0] for p in points]),
            np.array([p["cpu_s"] for p in points]))


def fit(points: list[dict[str, Any]], held: st.CpuRates | None = None) -> np.ndarray:
    """Seconds per matmul FLOP, per attention FLOP, per element and the overhead minimising the relative error
    against the CPU time per step of `points`; with `held`, only the matmul and overhead terms are fit and the
    attention and element-wise terms kept at `held`'s (kernels a change of GEMM library leaves alone)."""
    x, t = _terms(points)
    if held is None:
        coefficients, *_ = np.linalg.lstsq(x / t[:, None], np.ones(len(points)), rcond=None)
        return coefficients
    fixed = np.array([1 / held.attention, held.seconds_per_element])
    known = x[:, 1:3] @ fixed
    (mm, over), *_ = np.linalg.lstsq(x[:, [0, 3]] / t[:, None], 1 - known / t, rcond=None)
    return np.array([mm, fixed[0], fixed[1], over])


def _worst(coefficients: np.ndarray, points: list[dict[str, Any]]) -> float:
    x, t = _terms(points)
    return float(np.max(np.abs(x @ coefficients / t - 1)))


def table(points: list[dict[str, Any]]) -> list[str]:
    rows = ["| point | params | max_len | rows/step | world | backend | threads | linears | measured s/step | "
            "CPU s/step | predicted s/step | error vs measured | error vs CPU | peak RSS MB (all ranks) | "
            "load before / after |", "| --- " * 15 + "|"]
    for p in points:
        pred = (f"{p['pred_s']:.3f} | {p['err']:+.0%} | {p['err_cpu']:+.0%}" if "pred_s" in p else
                "not estimated (RL) | | ")
        rows.append(f"| {p['name']} | {p['params'] / 1e6:.1f}M | {p['max_len']} | {p['rows']} | {p['world']} | "
                    f"{p['backend']} | {p['threads']} | {p.get('kernel', 'aten')} | {p['step_s']:.3f} | "
                    f"{p['cpu_s']:.3f} | {pred} | "
                    f"{p['peak_rss_mb']:.0f} | {p['load_before']} / {p['load_after']} |")
    return rows


def _plot_lines(ax: Any, series: dict[str, list[dict[str, Any]]], x: str, y: str, pred: bool, base: int) -> None:
    for label, pts in series.items():
        pts = sorted(pts, key=lambda p: p[x])
        line, = ax.plot([p[x] for p in pts], [p[y] for p in pts], "o-", label=label)
        if y == "cpu_s":  # the wall time too, faint: a shared machine stretches it
            ax.plot([p[x] for p in pts], [p["step_s"] for p in pts], ":", color=line.get_color(), alpha=0.5,
                    label=f"{label}, wall time")
        if pred:
            ax.plot([p[x] for p in pts], [p["pred_s"] for p in pts], "--", color=line.get_color(), alpha=0.6,
                    label=f"{label}, --dry_run estimate")
    ax.set_xscale("log", base=base)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def picture(path: Path, title: str, series: dict[str, list[dict[str, Any]]], x: str, xlabel: str,
            base: int = 2, pred: bool = True) -> bool:
    """Two panels: step time (measured, and the estimate dashed) and peak RSS against `x`; False: no points."""
    series = {k: v for k, v in series.items() if v}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    _plot_lines(left, series, x, "cpu_s", pred, base)
    left.set(xlabel=xlabel, ylabel="seconds per optimizer step (CPU time)", title=f"{title}: step time")
    _plot_lines(right, series, x, "peak_rss_mb", False, base)
    right.set(xlabel=xlabel, ylabel="peak RSS, MB (all ranks)", title=f"{title}: peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def world_picture(path: Path, points: list[dict[str, Any]]) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in points if p["backend"] != "single" or p["name"].endswith("-w1-single")]
    if not pts:
        return False
    labels = [f"{p['trainer']} w{p['world']}\n{p['backend']}" for p in pts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(pts))
    left.bar(x - 0.2, [p["cpu_s"] for p in pts], 0.4, label="CPU time (the slower rank)")
    left.bar(x + 0.2, [p["pred_s"] for p in pts], 0.4, label="--dry_run estimate")
    left.set(ylabel="seconds per optimizer step", title="25M, 8 x 128 tokens a step: world size and backend")
    right.bar(x, [p["peak_rss_mb"] for p in pts])
    right.set(ylabel="peak RSS, MB (all ranks summed)", title="peak memory")
    for ax in (left, right):
        ax.set_xticks(x, labels, fontsize=7)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def pictures(points: list[dict[str, Any]], out: Path, stem: str = "cost_curves") -> list[Path]:
    by = {p["name"]: p for p in points}
    single = [p for p in points if p["world"] == 1 and p["threads"] == 1 and p["backend"] == "single"]
    grpo = {f"GRPO {m}, {GRPO_PROMPTS} prompts": [p for p in single if p["trainer"] == "grpo" and p["model"] == m]
            for m in ("tiny", "25m")}
    seq = {f"{t} {m}": [p for p in single if p["trainer"] == t and p["model"] == m and p["rows"] == r]
           for t, m, r in (("sft", "tiny", 2), ("dpo", "tiny", 1), ("sft", "25m", 2), ("dpo", "25m", 1))}
    size = {t: [p for p in single if p["trainer"] == t and p["max_len"] == 256 and p["rows"] == r]
            for t, r in (("sft", 4), ("dpo", 2))}
    paths = [out / f"{stem}_{name}.png" for name in ("seq", "model", "world", "grpo")]
    drawn = [picture(paths[0], "sequence length (SFT 2 rows, DPO 1 pair)", seq, "max_len",
                     "tokens per row (max_len)"),
             picture(paths[1], "model size (256 tokens; SFT 4 rows, DPO 2 pairs)", size, "params", "parameters",
                     base=10),
             world_picture(paths[2], [by[n] for n in by if "-w" in n]),
             picture(paths[3], "GRPO through train_ppo (32 new tokens)", grpo, "samples", "samples per prompt",
                     pred=False)]
    return [path for path, ok in zip(paths, drawn) if ok]


def _fit_line(label: str, coefficients: np.ndarray, points: list[dict[str, Any]]) -> str:
    mm, att, elem, over = coefficients
    return (f"- {label}: matmuls {1 / mm / 1e9:.0f} GFLOP/s, attention {1 / att / 1e9:.0f} GFLOP/s, "
            f"{elem * 1e9:.1f} ns per element, {over * 1e3:.1f} ms per step (worst point within "
            f"{_worst(coefficients, points):.0%} of its CPU time per step).")


def derived(points: list[dict[str, Any]]) -> list[str]:
    """This run's fits of the planner's constants (per kernel), beside the constants the planner uses, and a
    held-out check."""
    base = [p for p in points if p["backend"] == "single" and p["threads"] == 1 and p["trainer"] in ("sft", "dpo")]
    lines = []
    for kernel in sorted({p.get("kernel", "aten") for p in base}):
        group = [p for p in base if p.get("kernel", "aten") == kernel]
        rates = st.cpu_rates(kernel == "onednn")
        sft, dpo = ([p for p in group if p["trainer"] == t] for t in ("sft", "dpo"))
        lines += [f"Linears on {kernel} ({len(group)} world-1, one-thread SFT and DPO points, CPU time per step):",
                  _fit_line("fit of all four terms", fit(group), group),
                  _fit_line("fit of the matmul rate and the overhead, attention and element-wise terms held at the "
                            "planner's MKL fit's (their kernels do not change with the GEMM library)",
                            fit(group, st.MKL), group),
                  f"- the planner uses ({rates.kernel}): {rates.matmul / 1e9:.0f}, {rates.attention / 1e9:.0f} "
                  f"GFLOP/s, {rates.seconds_per_element * 1e9:.1f} ns and {rates.overhead_s * 1e3:.1f} ms "
                  "(`rlhfkit/planner/step_time.py`).",
                  *([f"- held out: fit (all four terms) on the SFT points alone, the DPO points (a reference "
                     f"forward and two rows a pair, which the fit never saw) come within {_worst(fit(sft), dpo):.0%} "
                     "of their CPU time per step."] if sft and dpo else []), ""]
    for p in (p for p in points if p["threads"] > 1 and p["world"] == 1 and "work" in p):
        rates = p["est"].rates
        one = st.cpu_step_time(p["work"], 0, 1, rates).seconds - rates.overhead_s
        speedup = one / (p["step_s"] - rates.overhead_s)
        lines.append(f"- {p['name']} (load {p['load_before'].split()[0]}): {speedup:.2f}x the one-thread estimate's "
                     f"speed with {p['threads']} threads, the fixed overhead aside (planner: "
                     f"{one / (p['pred_s'] - rates.overhead_s):.2f}x).")
    for p in (p for p in points if p["world"] > 1 and "work" in p):
        compute = st.cpu_step_time(p["work"], 0, 1, p["est"].rates).seconds
        rate_b = 3 * 4 * p["params"] / max(p["cpu_s"] - compute, 1e-9)
        planner = p["est"].rates.gloo_bytes_per_s / 1e9
        lines.append(f"- {p['name']}: {p['cpu_s'] - compute:.2f} s of CPU time per step beyond compute: "
                     f"{rate_b / 1e9:.2f} GB/s of parameter traffic (planner: {planner:.2f}).")
    return lines


def _within(label: str, group: list[dict[str, Any]]) -> str:
    if not group:
        return f"- {label}: no points"
    worst = max(group, key=lambda p: abs(p["err"]))
    worst_cpu = max(group, key=lambda p: abs(p["err_cpu"]))
    return (f"- {label} ({len(group)} points): {sum(abs(p['err']) <= 0.25 for p in group)} within 25% of the measured "
            f"step time (worst {worst['name']}: {worst['err']:+.0%}); {sum(abs(p['err_cpu']) <= 0.25 for p in group)}"
            f" within 25% of the CPU time per step (worst {worst_cpu['name']}: {worst_cpu['err_cpu']:+.0%}).")


def acceptance(points: list[dict[str, Any]]) -> list[str]:
    offline = [p for p in points if p["trainer"] in ("sft", "dpo")]
    one = [p for p in offline if p["backend"] == "single" and p["threads"] == 1]
    quiet = [p for p in one if max(float(p[k].split()[0]) for k in ("load_before", "load_after")) < 2.6]
    return [_within("SFT and DPO, one process, one thread", one),
            _within("the same, only the points taken while the load average stayed under 2.6 (a core free)", quiet),
            _within("SFT and DPO, one process, two threads", [p for p in offline if p["threads"] == 2]),
            _within("SFT and DPO under torchrun (ZeRO-3, FSDP2; world 1 and 2)",
                    [p for p in offline if p["backend"] != "single"])]


def report(path: Path) -> None:
    data = json.loads(path.read_text())
    points = data["points"]
    shape_of = shapes(data, {p["model"] for p in points})
    for p in points:
        shape = shape_of[p["model"]]
        p.update(params=shape.params(), samples=p["rows"] // GRPO_PROMPTS)
        if p["trainer"] == "grpo":  # not estimated: generation dominates
            continue
        est = predict(p, shape, data.get("probes", {}))
        p.update(est=est, work=est.work, pred_s=est.seconds, err=est.seconds / p["step_s"] - 1,
                 err_cpu=est.seconds / (p["cpu_s"] / p["threads"]) - 1)  # CPU time over its threads
    out = path.parent
    images = pictures(points, out, path.stem)
    if path.stem == "cost_curves":  # the current run's pictures are the docs page's; a history file keeps its own
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        for image in images:
            shutil.copy(image, DOCS_IMAGES / image.name)
    loads = [float(p[k].split()[0]) for p in points for k in ("load_before", "load_after")]
    text = ["# Cost curves: step time and peak memory (bench/cost_curves.py)", "",
            *([data["note"], ""] if "note" in data else []),
            f"Run {data['date']}. Machine: {data['machine']}; {data['versions']}. One-minute load average from "
            f"{min(loads):.2f} to {max(loads):.2f} over the run (each point's before / after in the table; a machine "
            "shared by several engineers: a point whose wall time is well above its CPU time waited for a core).", "",
            "Settings: random-init Llamas on the demo's 2,048-token vocabulary, fp32, AdamW, every row filled to "
            "max_len (a short prompt, a completion or both DPO responses cut to max_len), one micro-batch per rank, "
            "one torch thread per process unless the threads column says 2; `linears`: the fp32 GEMM kernel the linear "
            "layers ran on (`aten`: MKL through `F.linear`; `onednn`: rlhfkit.models.cpu_gemm's routing); step time "
            "= median gap between "
            "optimizer-step ends after one warm-up step (the slower rank's); peak RSS = the processes' own "
            "high-water marks (VmHWM; runs before 2026-11-29: `ru_maxrss`), "
            "summed over ranks. `predicted` is what `--dry_run` prints for the same config "
            "(`rlhfkit/planner/step_time.py`); error = predicted / measured - 1 (against CPU time: over the "
            "process's threads).", "",
            "## Acceptance (issue 26, item 4: the estimate within 25% of measured on the CPU workloads)", "",
            *acceptance(points), "", "## The planner's constants against this run", "", *derived(points), "",
            "## Every point", "", *table(points), "",
            "## Pictures", "", *[f"![{i.stem}]({i.name})" for i in images], ""]
    path.with_suffix(".md").write_text("\n".join(text))
    print("\n".join(text))
