"""Mixing several sources with --dataset_probs: validation and the documented sampling rule."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlhfkit.data.readers import load_mixture, mixture_counts, parse_probs
from rlhfkit.errors import UserError


@pytest.fixture
def sources(tmp_path):
    """a.jsonl: 10 records, b.jsonl: 30 records."""
    for name, n in (("a", 10), ("b", 30)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"src": name, "i": i}) + "\n" for i in range(n)))
    return f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"


def test_largest_remainder_counts():
    assert mixture_counts([0.5, 0.5], 40) == [20, 20]
    assert mixture_counts([1 / 3, 1 / 3, 1 / 3], 10) == [4, 3, 3]  # equal remainders: lower index first
    assert mixture_counts([0.25, 0.75], 7) == [2, 5]  # quotas 1.75, 5.25
    assert mixture_counts([0.0, 1.0], 5) == [0, 5]


def test_mixture_counts_and_oversampling(sources):
    mixed = load_mixture(sources, "0.5,0.5", seed=1)
    assert len(mixed) == 40
    assert Counter(r["src"] for r in mixed) == {"a": 20, "b": 20}
    a_uses = Counter(r["i"] for r in mixed if r["src"] == "a")
    assert set(a_uses.values()) == {2}  # 20 drawn from 10: every record exactly twice
    b_ids = [r["i"] for r in mixed if r["src"] == "b"]
    assert len(set(b_ids)) == 20  # 20 drawn from 30: no repeats


def test_mixture_deterministic_and_capped(sources):
    first = load_mixture(sources, "0.25,0.75", max_samples=8, seed=7)
    again = load_mixture(sources, "0.25,0.75", max_samples=8, seed=7)
    other = load_mixture(sources, "0.25,0.75", max_samples=8, seed=8)
    assert [dict(r) for r in first] == [dict(r) for r in again]
    assert [dict(r) for r in first] != [dict(r) for r in other]
    assert Counter(r["src"] for r in first) == {"a": 2, "b": 6}


def test_no_probs_concatenates_and_single_source_keeps_order(sources):
    mixed = load_mixture(sources, None, seed=3)
    assert Counter(r["src"] for r in mixed) == {"a": 10, "b": 30}
    assert len({(r["src"], r["i"]) for r in mixed}) == 40
    a_path = sources.split(",")[0]
    assert [r["i"] for r in load_mixture(a_path, "1.0", max_samples=4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("probs,pattern", [
    ("0.5", r"--dataset_probs 0.5 has 1 values but --dataset names 2 datasets"),
    ("0.5,0.2,0.3", "has 3 values"),
    ("-0.5,1.5", "must be non-negative"),
    ("0.5,0.6", "sum to 1.1, not 1"),
    ("a,b", "expected comma-separated numbers"),
])
def test_bad_probs(sources, probs, pattern):
    with pytest.raises(UserError, match=pattern):
        load_mixture(sources, probs)


def test_probs_sum_tolerance():
    assert parse_probs("0.3333333,0.6666667", 2) == [0.3333333, 0.6666667]
    with pytest.raises(UserError):
        parse_probs("0.333,0.666", 2)
