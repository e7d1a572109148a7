"""Every accepted source form round-trips; every bad input is one clear UserError."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhfkit.data.readers import Record, load_records
from rlhfkit.errors import UserError

ROWS = [{"input": "hi", "output": "hello", "n": 1}, {"input": "how", "output": "fine", "n": 2},
        {"input": "bye", "output": "ok", "n": 3}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_round_trip_and_provenance(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    records = load_records(str(path))
    assert records == ROWS
    assert all(isinstance(r, Record) for r in records)
    assert (records[2].source, records[2].index) == (str(path), 2)
    assert records[2].where() == f"{path}: record 3"


@pytest.mark.parametrize("content", [json.dumps(ROWS), json.dumps({"data": ROWS}), json.dumps({"train": ROWS}),
                                     "\n".join(json.dumps(r) for r in ROWS)])
def test_json_forms(tmp_path, content):
    (tmp_path / "d.json").write_text(content)
    assert load_records(str(tmp_path / "d.json")) == ROWS


def test_parquet_csv_arrow(tmp_path):
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("input,output,n\nhi,hello,1\nhow,fine,2\nbye,ok,3\n")
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    for name in ("d.parquet", "d.csv", "file.arrow", "stream.arrow"):
        assert load_records(str(tmp_path / name)) == ROWS, name


def test_max_samples_keeps_file_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_records(str(path), max_samples=2) == ROWS[:2]
    with pytest.raises(UserError, match="--max_samples 0"):
        load_records(str(path), max_samples=0)


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    assert load_records(str(tmp_path / "one")) == ROWS
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "two"))
    assert load_records(str(tmp_path / "two")) == ROWS
    assert load_records(str(tmp_path / "two"), split="test") == [ROWS[1]]
    assert load_records(f"{tmp_path / 'two'}@test") == [ROWS[1]]
    with pytest.raises(UserError, match=r"no split 'validation' \(it has train, test\)"):
        load_records(str(tmp_path / "two"), split="validation", arg_name="--eval_dataset")


def test_saved_dataset_without_datasets_installed(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    assert load_records(str(tmp_path / "one")) == ROWS


def test_directory_of_files_by_split(tmp_path):
    write_jsonl(tmp_path / "train-00000-of-00002.jsonl", ROWS[:2])
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), tmp_path / "train-00001-of-00002.parquet")
    (tmp_path / "test").mkdir()
    write_jsonl(tmp_path / "test" / "part.jsonl", ROWS[:1])
    assert load_records(str(tmp_path)) == ROWS
    assert load_records(f"{tmp_path}@test") == ROWS[:1]
    with pytest.raises(UserError, match="no data files for split 'dev'.*found splits: test, train"):
        load_records(str(tmp_path), split="dev")


def test_directory_with_split_named_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "validation.jsonl", ROWS[2:])
    assert load_records(str(tmp_path)) == ROWS
    assert load_records(str(tmp_path), split="validation") == ROWS[2:]


def test_directory_of_unnamed_files_reads_all(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    records = load_records(str(tmp_path))
    assert records == ROWS
    assert records[1].source == str(tmp_path / "b.jsonl") and records[1].index == 0


def test_hub_name_is_tried_only_when_no_local_path(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        if name == "org/known":
            return datasets.Dataset.from_list(ROWS)
        raise ConnectionError("Couldn't reach 'org/unknown' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.chdir(tmp_path)
    assert load_records("org/known@test") == ROWS
    assert calls == [("org/known", "test")]
    with pytest.raises(UserError, match=r"^--dataset org/unknown: no such local path.*hub unreachable"):
        load_records("org/unknown")
    # a local-looking path (data-file suffix) is never sent to the hub
    with pytest.raises(UserError, match="no such file or directory"):
        load_records("org/missing.jsonl")
    assert len(calls) == 2


# -- errors -------------------------------------------------------------------------------------------------
def test_missing_path_names_flag_path_and_forms(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError) as e:
        load_records(missing, arg_name="--eval_dataset")
    msg = str(e.value)
    assert msg.startswith(f"--eval_dataset {missing}: no such file or directory")
    assert ".jsonl" in msg and "save_to_disk" in msg and "org/name" in msg
    assert "\n" not in msg


def test_bad_jsonl_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(UserError, match=r"d.jsonl: line 3 is not valid JSON"):
        load_records(str(path))


def test_bad_json_document_line_number(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n {"a": 1},\n {"a": }\n]')
    with pytest.raises(UserError, match=r"d.json: not valid JSON at line 3"):
        load_records(str(path))


@pytest.mark.parametrize("name,content", [("e.jsonl", "\n\n"), ("e.json", ""), ("e.json", "[]"),
                                          ("e.csv", "input,output\n"), ("e.csv", "")])
def test_empty_sources(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=r"has no records$"):
        load_records(str(tmp_path / name))


def test_corrupt_parquet_and_unsupported_suffix(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="bad.parquet: cannot read as parquet"):
        load_records(str(tmp_path / "bad.parquet"))
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(UserError, match="unsupported file type '.txt'"):
        load_records(str(tmp_path / "d.txt"))


def test_non_object_records_and_single_file_split(tmp_path):
    (tmp_path / "d.json").write_text('[{"a": 1}, "oops"]')
    with pytest.raises(UserError, match=r"d.json: record 2 is a str, not an object"):
        load_records(str(tmp_path / "d.json"))
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_records(f"{path}@train") == ROWS
    with pytest.raises(UserError, match=r"d.jsonl@test: this source has no splits.*drop '@test'"):
        load_records(f"{path}@test")
    (tmp_path / "splits.json").write_text(json.dumps({"train": ROWS, "test": ROWS[:1]}))
    assert load_records(f"{tmp_path / 'splits.json'}@test") == ROWS[:1]
    with pytest.raises(UserError, match=r"splits.json: no split 'dev' \(it has train, test\)"):
        load_records(f"{tmp_path / 'splits.json'}@dev")


def test_unsplit_directories_reject_other_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(UserError, match="saved@test: this source has no splits"):
        load_records(f"{tmp_path / 'saved'}@test")
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "a.jsonl", ROWS)
    assert load_records(f"{tmp_path / 'files'}@train") == ROWS
    with pytest.raises(UserError, match="files@validation: this source has no splits"):
        load_records(f"{tmp_path / 'files'}@validation")


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085", "\x1c", "\x0b"])
def test_unicode_line_separators_inside_strings_are_not_line_breaks(tmp_path, suffix, separator):
    # json.dumps(ensure_ascii=False) writes these unescaped; they are valid inside JSON strings, but
    # str.splitlines() treats them as line ends (the old reader called such lines "not valid JSON").
    rows = [{"input": f"a{separator}b", "output": "c"}, {"input": "d", "output": f"e{separator}"}]
    path = tmp_path / f"d.{suffix}"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_records(str(path)) == rows


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_utf8_byte_order_mark_and_crlf_are_accepted(tmp_path, suffix):
    path = tmp_path / f"d.{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in ROWS).encode())
    assert load_records(str(path)) == ROWS
