"""The GPU suite's smoke mode (bench/gpu/suite.py --smoke) end to end on the CPU at tiny sizes: both correctness
checks pass with real numbers, and every workload trains and reports a step time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_end_to_end(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "suite.py"), "--smoke", "--no_trl",
                           "--threads", "1", "--workdir", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    bf16, logprobs = results["checks"]["bf16_vs_fp32"], results["checks"]["engine_logprobs"]
    assert bf16["passed"] and len(bf16["fp32"]) == len(bf16["bf16"]) == 3
    assert 0 < bf16["max_rel_diff"] < 0.05  # bf16 really ran (not bit-identical) and stayed close
    assert logprobs["passed"] and logprobs["tokens"] > 0 and logprobs["max_abs_diff"] < 1e-4
    (run,) = results["rlhfkit"]
    for workload in ("sft", "dpo", "grpo"):
        assert len(run[workload]) >= 1 and all(t > 0 for t in run[workload]), workload
    assert "trl" not in results
    table = (tmp_path / "gpu_smoke.md").read_text()
    assert "| bf16_vs_fp32 | yes |" in table and "TRL was not run" in table
