"""The GPU suite's report: environment, work per step, the side-by-side table with MFU and peak memory, and the
notes (errors, skipped stages), from the results dict of bench/gpu/suite.py."""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
import flops

WORKLOADS = ("sft", "dpo", "grpo")


def environment() -> str:
    """GPU, driver, CUDA, Python and package versions (TRL's as installed in bench/.trl)."""
    import importlib.metadata as md

    import torch

    gpu = "no GPU"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 -- the driver version is a nicety
            driver = "?"
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}, CUDA {torch.version.cuda}"
    found = []
    for name in ("torch", "transformers", "deepspeed", "accelerate", "datasets", "peft"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    trl = sorted(common.TRL_DIR.glob("trl-*.dist-info"))
    found.append(f"trl {trl[-1].name[4:-10]} (bench/.trl)" if trl else "trl not installed")
    return f"{gpu}; Python {platform.python_version()}; " + ", ".join(found)


def per_step(sizes: Any, lengths: dict, model: Path) -> dict:
    """Work per optimizer step: what the throughput metric counts and the model FLOPs (flops.py)."""
    shape = flops.model_shape(model)
    sft_rows, dpo_pairs = len(lengths["sft"]), len(lengths["dpo"]) // 2
    return {"units": {"sft": sum(lengths["sft"]) * sizes.sft_batch / sft_rows, "dpo": sizes.dpo_batch, "grpo": 1},
            "flops": {"sft": flops.train_flops(shape, lengths["sft"]) * sizes.sft_batch / sft_rows,
                      "dpo": (flops.train_flops(shape, lengths["dpo"]) + flops.forward_flops(shape, lengths["dpo"]))
                      * sizes.dpo_batch / dpo_pairs},
            "matmul_params": shape.matmul_params}


def comparison_rows(results: dict, work: dict) -> list[str]:
    peak = results.get("peak", {}).get("tflops")
    metric = {"sft": "tokens/s", "dpo": "pairs/s", "grpo": "s/step"}
    rows = ["| workload | metric | rlhfkit | TRL | ratio rlhfkit/TRL (step time) | rlhfkit s/step | TRL s/step | "
            "rlhfkit MFU | TRL MFU | rlhfkit peak GPU GiB | TRL peak GPU GiB | steps timed (rlhfkit, TRL) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload in WORKLOADS:
        cells: dict[str, list[str]] = {"value": [], "step": [], "mfu": [], "mem": [], "n": []}
        medians = {}
        for system in common.SYSTEMS:
            runs = results.get(system, [])
            times = [t for run in runs for t in run.get(workload, [])]
            mems = [run[f"{workload}_peak_gib"] for run in runs if run.get(f"{workload}_peak_gib") is not None]
            cells["mem"].append(f"{max(mems):.1f}" if mems else "n/a")
            cells["n"].append(str(len(times)))
            if not times:
                cells["value"].append("not run" if not runs else "failed")
                cells["step"].append("-")
                cells["mfu"].append("-")
                continue
            medians[system] = statistics.median(times)
            value = medians[system] if workload == "grpo" else work["units"][workload] / medians[system]
            cells["value"].append(f"{value:.3g}")
            cells["step"].append(f"{medians[system]:.3f}")
            mfu = work["flops"].get(workload)
            cells["mfu"].append(f"{mfu / medians[system] / (peak * 1e12):.1%}" if mfu and peak else "-")
        ratio = f"**{medians['rlhfkit'] / medians['trl']:.2f}**" if len(medians) == 2 else "n/a"
        rows.append(f"| {workload} | {metric[workload]} | {' | '.join(cells['value'])} | {ratio} | "
                    f"{' | '.join(cells['step'])} | {' | '.join(cells['mfu'])} | {' | '.join(cells['mem'])} | "
                    f"{', '.join(cells['n'])} |")
    return rows


def notes(results: dict) -> list[str]:
    """Errors, skipped stages and the GRPO response lengths (both systems should generate about as many tokens)."""
    lines = [f"- {note}" for note in results["notes"]]
    for system in common.SYSTEMS:
        for i, run in enumerate(results.get(system, [])):
            lines += [f"- {system} run {i + 1} {w}: **{run[f'{w}_error']}**" for w in WORKLOADS if f"{w}_error" in run]
            grpo = run.get("grpo_extra", {})
            if "response_length" in grpo:
                lines.append(f"- {system} run {i + 1} grpo: mean response length {grpo['response_length']:.1f} tokens"
                             + (f", phases (s) {json.dumps(grpo['phases_s'])}" if "phases_s" in grpo else ""))
    return lines


def report(results: dict, sizes: Any, work: dict, header: str) -> list[str]:
    peak = results.get("peak", {})
    lines = [header, f"Sizes: {json.dumps(asdict(sizes))}; {work['matmul_params'] / 1e6:.1f}M matmul parameters.",
             f"Measured matmul peak: {peak.get('tflops', float('nan')):.3g} TFLOP/s ({peak.get('shape')} "
             f"{peak.get('dtype')}), the denominator of MFU (PaLM's model FLOPs, bench/gpu/flops.py).",
             f"Stage wall times (s): {json.dumps({k: round(v, 1) for k, v in results['stages'].items()})}.",
             "", "| check | passed | numbers |", "| --- | --- | --- |"]
    for name, c in results["checks"].items():
        numbers = {k: v for k, v in c.items() if k != "passed"}
        lines.append(f"| {name} | {'yes' if c['passed'] else '**no**'} | {json.dumps(numbers)} |")
    lines += ["", *comparison_rows(results, work), "", "Ratio < 1: rlhfkit faster. SFT tokens: every non-pad token "
              "of a step; DPO MFU counts the frozen reference forward. Step time: median gap between optimizer-step "
              "ends after the warm-up steps, over every timed step of every run.", ""]
    lines += notes(results)
    if "trl" not in results and not any("trl-" in note for note in results["notes"]):
        lines += ["", "TRL was not run: bench/.trl holds no TRL (install it with `pip install --no-deps --target "
                  "bench/.trl trl==1.16.0`)."]
    return lines
