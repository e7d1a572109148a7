"""Retrying a failed reward call in halves, so that one bad sample costs only itself.

A reward function is called on spans of samples (`[lo, hi)`, up to --micro_rollout_batch_size of them). When a call
fails as a whole (it raised, hung, crashed its worker or returned the wrong type or length), we cannot tell which
of its samples caused it; so both halves of the span are called again, recursively, until a part succeeds or is a
single sample that fails alone. The good samples of a failed call thus get the rewards the function gives them
(bisection, as in delta debugging: Zeller & Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", IEEE
TSE 2002), and only a sample that fails alone gets the fallback.

The retries run in rounds: each round calls every part that still has to be tried at once (the caller spreads
them over its workers), so a sample that hangs costs one timeout per round, 1 + ceil(log2 k) timeouts for a span of
k samples (the first call and ceil(log2 k) rounds of retries), however many spans hang, given enough workers.

This module is pure: `call_in_halves` gets the function that runs one round of calls; `failure_metrics` counts
the failed samples by kind and the retries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

Span = tuple[int, int]  # samples lo (inclusive) to hi (exclusive)


class Outcome(Protocol):
    @property
    def ok(self) -> bool: ...


R = TypeVar("R", bound=Outcome)


def halves(span: Span) -> list[Span]:
    """The two halves of a span of two or more samples (the first half the smaller one when it is odd)."""
    lo, hi = span
    mid = (lo + hi) // 2
    return [(lo, mid), (mid, hi)]


def call_in_halves(spans: Sequence[Span], run_round: Callable[[list[Span]], list[R]]) -> list[tuple[Span, R]]:
    """Call every span (`run_round(spans) -> one outcome per span, in order`), then split each failed span of more
    than one sample in halves and call those in the next round, until every part succeeded or is one sample.

    Returns the final (span, outcome) pairs, in sample order: they cover the input spans exactly; a failed one is
    always a single sample (or an empty span given as input)."""
    final: dict[Span, R] = {}
    pending = list(spans)
    while pending:
        outcomes = run_round(pending)
        if len(outcomes) != len(pending):
            raise ValueError(f"run_round returned {len(outcomes)} outcomes for {len(pending)} spans")
        retry: list[Span] = []
        for span, outcome in zip(pending, outcomes):
            if outcome.ok or span[1] - span[0] <= 1:
                final[span] = outcome
            else:
                retry.extend(halves(span))
        pending = retry
    return sorted(final.items(), key=lambda item: item[0])


def rounds_needed(k: int) -> int:
    """Rounds of calls a span of k samples takes at most: the first call and ceil(log2 k) rounds of retries."""
    return 1 + max(0, (k - 1).bit_length())


@dataclass
class Attempt:
    """One reward call: its parsed output, or how it failed (`kind` as in the metrics, `error` one line)."""

    kind: str | None = None
    error: str = ""
    out: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.out is not None


def failure_metrics(failures: Sequence[tuple[int, int, str, str]], rounds: Sequence[float]) -> dict[str, float]:
    """`reward/failures` and `reward/failure_kinds/<kind>` (failed samples; `failures` holds (first sample,
    samples, kind, reason) entries), `reward/retry_rounds` (rounds of calls after the first) and
    `reward/retry_seconds` (their wall time; `rounds` holds each round's seconds)."""
    kinds: dict[str, int] = {}
    for _, count, kind, _ in failures:
        kinds[kind] = kinds.get(kind, 0) + count
    return {"reward/failures": float(sum(kinds.values())),
            **{f"reward/failure_kinds/{k}": float(v) for k, v in kinds.items()},
            "reward/retry_rounds": float(max(0, len(rounds) - 1)), "reward/retry_seconds": float(sum(rounds[1:]))}
