"""A failed reward call is retried in halves: the splitting on its own (a fake call function), then through the
user-code pool with a real reward file that raises, returns NaN and hangs on some labels."""

from __future__ import annotations

import time

import pytest

from rlhfkit.rewards.halves import Attempt, call_in_halves, failure_metrics, halves, rounds_needed
from rlhfkit.rewards.sources import RewardFunction


class FakeCalls:
    """A call over a span fails when it holds a bad sample; every round and its spans are recorded."""

    def __init__(self, bad: set[int]):
        self.bad = bad
        self.rounds: list[list[tuple[int, int]]] = []

    def __call__(self, spans):
        self.rounds.append(list(spans))
        return [Attempt("exception", f"bad in {s}") if self.bad & set(range(*s)) else Attempt(out={"span": s})
                for s in spans]


def test_halves_and_rounds_needed():
    assert halves((0, 8)) == [(0, 4), (4, 8)]
    assert halves((3, 6)) == [(3, 4), (4, 6)]
    assert [rounds_needed(k) for k in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 3, 3, 4, 4, 5, 5]


def test_only_samples_that_fail_alone_are_failed_parts():
    calls = FakeCalls(bad={1, 6})
    parts = call_in_halves([(0, 4), (4, 8), (8, 12)], calls)
    assert [span for span, _ in parts] == [(0, 1), (1, 2), (2, 4), (4, 6), (6, 7), (7, 8), (8, 12)]
    assert [span for span, a in parts if not a.ok] == [(1, 2), (6, 7)]
    # each round calls every part still in doubt at once: 1 + log2(4) rounds
    assert calls.rounds == [[(0, 4), (4, 8), (8, 12)], [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (1, 2), (6, 7),
                                                                                          (7, 8)]]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 8, 13])
def test_every_bad_sample_is_isolated_within_the_round_bound(k):
    """Against an independent answer: the failed parts are exactly the bad samples, the parts cover 0..n, and no
    span takes more than 1 + ceil(log2 k) rounds, whatever samples are bad."""
    import random

    rng = random.Random(k)
    n = 3 * k
    for _ in range(20):
        bad = {i for i in range(n) if rng.random() < 0.3}
        calls = FakeCalls(bad)
        parts = call_in_halves([(lo, min(lo + k, n)) for lo in range(0, n, k)], calls)
        assert {span[0] for span, a in parts if not a.ok} == bad
        assert all(hi - lo == 1 for (lo, hi), a in parts if not a.ok)
        assert [lo for (lo, _), _ in parts] == sorted(lo for (lo, _), _ in parts)
        assert sum(hi - lo for (lo, hi), _ in parts) == n and parts[0][0][0] == 0 and parts[-1][0][1] == n
        assert len(calls.rounds) <= rounds_needed(k)


def test_a_run_round_with_the_wrong_number_of_outcomes_is_a_bug():
    with pytest.raises(ValueError, match="2 outcomes for 1 spans"):
        call_in_halves([(0, 2)], lambda spans: [Attempt(out={}), Attempt(out={})])


def test_failure_metrics_count_samples_by_kind_and_retry_time():
    failures = [(1, 1, "exception", "x"), (4, 1, "timeout", "y"), (5, 1, "exception", "z"), (7, 1, "non_finite", "")]
    assert failure_metrics(failures, [2.0, 1.5, 0.25]) == {
        "reward/failures": 4.0, "reward/failure_kinds/exception": 2.0, "reward/failure_kinds/timeout": 1.0,
        "reward/failure_kinds/non_finite": 1.0, "reward/retry_rounds": 2.0, "reward/retry_seconds": 1.75}
    assert failure_metrics([], [0.1]) == {"reward/failures": 0.0, "reward/retry_rounds": 0.0,
                                          "reward/retry_seconds": 0.0}


# -- through the user-code pool -----------------------------------------------------------------------------------
BY_LABEL = """
import time


def reward_func(queries, prompts, labels):
    if "raise" in labels:
        raise ValueError("boom on purpose")
    if "sleep" in labels:
        time.sleep(3600)
    if "short" in labels:
        return []
    return [float("nan") if label == "nan" else len(q) / 10 for q, label in zip(queries, labels)]
"""


def alone(query: str, label: str) -> float:
    """What BY_LABEL gives a good sample scored alone."""
    return len(query) / 10


def test_bad_samples_cost_only_themselves_and_a_hang_costs_one_timeout_per_round(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(BY_LABEL)
    labels = ["ok", "raise", "ok", "ok", "nan", "ok", "sleep", "ok",
              "ok", "ok", "ok", "short", "ok", "ok", "ok", "ok"]
    queries = [f"query {i}" + "x" * i for i in range(16)]
    source = RewardFunction(str(path), workers=4, timeout=1.0, fallback=-1.0, max_failure_ratio=0.5, call_size=4)
    try:
        started = time.perf_counter()
        out = source.score({"queries": queries, "prompts": [""] * 16, "labels": labels})
        seconds = time.perf_counter() - started
        bad = {1, 4, 6, 11}
        assert out["rewards"].tolist() == pytest.approx(
            [-1.0 if i in bad else alone(q, lab) for i, (q, lab) in enumerate(zip(queries, labels))])
        metrics = out["metrics"]
        assert {k: v for k, v in metrics.items() if "retry" not in k} == {
            "reward/failures": 4.0, "reward/failure_kinds/exception": 1.0, "reward/failure_kinds/non_finite": 1.0,
            "reward/failure_kinds/timeout": 1.0, "reward/failure_kinds/wrong_length": 1.0}
        # calls of 4: the first round and 2 rounds of retries, the hang costing one 1 s timeout in each
        assert metrics["reward/retry_rounds"] == 2.0
        assert 2.0 <= metrics["reward/retry_seconds"] < 2.0 + 2.5  # + starting the replacement workers
        assert seconds < 3 * 1.0 + 4.0
        assert source.pool.replaced == 3  # the worker that hung was killed and replaced, once per round
        again = source.score({"queries": queries[:4], "prompts": [""] * 4, "labels": ["ok"] * 4})
        assert again["metrics"]["reward/failures"] == 0.0 and again["metrics"]["reward/retry_rounds"] == 0.0
    finally:
        source.close()


def test_a_function_that_fails_only_on_batches_is_scored_alone_with_one_warning(tmp_path, capsys):
    path = tmp_path / "reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return [float(len(queries[0]))]\n")
    source = RewardFunction(str(path), workers=2, timeout=5.0, max_failure_ratio=0.0, call_size=4)
    try:
        batch = {"queries": ["a", "bb", "ccc", "dddd"], "prompts": [""] * 4, "labels": [None] * 4}
        for _ in range(2):
            out = source.score(batch)
            assert out["rewards"].tolist() == [1.0, 2.0, 3.0, 4.0]
            assert out["metrics"]["reward/failures"] == 0.0 and out["metrics"]["reward/retry_rounds"] == 2.0
    finally:
        source.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1
    assert "a call of 4 samples failed (returned 1 rewards for 4 queries" in warnings[0]
