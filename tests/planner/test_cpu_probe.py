"""`rlhfkit.planner.cpu_probe`: each probe measures something positive and plausible, once per kernel and thread
count, and the one-thread probe leaves the process's thread count as it was (never against a timing bar: the
figures are bench/cost_curves.py's)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.models import cpu_gemm
from rlhfkit.planner import cpu_probe


def test_the_probes_measure_once_per_thread_count_and_kernel():
    before = torch.get_num_threads()
    probe = cpu_probe.measure_one_thread("aten")
    assert torch.get_num_threads() == before
    assert probe is not None and probe.threads == 1
    for value in (probe.gemm, probe.attention, probe.element_ns, probe.op_us):
        assert math.isfinite(value) and value > 0
    # a CPU of the last decade: 1-10,000 GFLOP/s, 0.01-100 ns per element, 0.1-1,000 us per small op
    assert 1e9 < probe.gemm < 1e13 and 1e9 < probe.attention < 1e13
    assert 0.01 < probe.element_ns < 100 and 0.1 < probe.op_us < 1000
    assert cpu_probe.measure_one_thread("aten") is probe  # cached: --dry_run measures once


def test_best_seconds_is_the_fastest_timed_call_after_an_untimed_warm_up(monkeypatch):
    clock = iter([0.0, 0.3, 1.0, 1.2, 2.0, 2.1])  # three timed calls: 0.3, 0.2 and 0.1 s
    monkeypatch.setattr(cpu_gemm.time, "perf_counter", lambda: next(clock))
    calls: list[int] = []
    assert cpu_gemm.best_seconds(lambda: calls.append(1), calls=3) == pytest.approx(0.1)
    assert len(calls) == 4  # the warm-up and three timed calls
