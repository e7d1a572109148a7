"""The output of batch_inference is written atomically: all records or none, and never a temporary file left."""

from __future__ import annotations

import json

import pytest

from rlhfkit.errors import UserError
from rlhfkit.inference.batch import write_jsonl_atomic


def test_write_is_all_or_nothing(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl_atomic(str(out), [{"a": 1}, {"b": "é"}]) == 2
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == [{"a": 1}, {"b": "é"}]

    def failing():
        yield {"c": 3}
        raise RuntimeError("scoring failed half way")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(str(out), failing())
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"a": 1}, {"b": "é"}]  # untouched
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no temporary file left behind


def test_a_directory_is_not_an_output_file(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        write_jsonl_atomic(str(tmp_path), [{"a": 1}])
