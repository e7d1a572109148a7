"""Read training records from one source: a local file, a local directory, or (when named) a hub dataset.

Accepted forms of a `--dataset` entry (`spec`):
- a file: `.json` (a list of records, `{"data": [...]}`, `{"<split>": [...]}`, or JSON lines), `.jsonl`,
  `.parquet`, `.csv`, `.arrow` / `.feather` (Arrow IPC file or stream);
- a directory written by `datasets` `save_to_disk` (a Dataset, or a DatasetDict: the split is picked);
- a directory holding such data files (recursively). Files named after a split (`train.jsonl`,
  `test-00000-of-00001.parquet`, `validation/part.csv`) are picked by split; otherwise every file is read;
- a hub name `org/name`, only when no such local path exists (needs network; fails with a clear error offline);
- a task generator, `reasoning_gym:<task>[?size=N&seed=S]`: problems drawn offline (data/generated_tasks.py).

`spec@split` picks a split (`data@test`); a single file is one split, so only `@train` is accepted for it.
Every record is a `Record`: a plain dict that also remembers its source and 0-based index for error messages.
`load_mixture` reads a comma-separated list of sources and mixes them with `--dataset_probs`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rlhfkit.data import generated_tasks
from rlhfkit.errors import UserError

FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".feather")
SPLIT_NAMES = ("train", "test", "validation", "valid", "eval", "dev")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_SPLIT = re.compile(r"^[A-Za-z_][\w.\-]*$")
ACCEPTED = ("accepted: a .json/.jsonl/.parquet/.csv/.arrow file, a directory written by datasets' save_to_disk "
            "or holding such files, a hub name like org/name (needs network), or reasoning_gym:<task>")


class Record(dict):
    """One data record (a plain dict) that remembers where it came from, for error messages."""

    def __init__(self, data: Any = (), source: str = "<memory>", index: int = 0):
        super().__init__(data)
        self.source = source
        self.index = index

    def where(self) -> str:
        """`path: record N` (1-based), the prefix of every error about this record."""
        return f"{self.source}: record {self.index + 1}"


def as_records(rows: list[Any], source: str) -> list[Record]:
    """Wrap rows as Records; a row that is not an object is a user error."""
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{source}: record {i + 1} is a {type(row).__name__}, not an object with named "
                            "fields")
        records.append(Record(row, source, i))
    return records


def split_spec(spec: str, split: str) -> tuple[str, str, bool]:
    """`data.jsonl@test` -> ("data.jsonl", "test", True). The last flag says the split was given in the spec."""
    if "@" in spec and not Path(spec).expanduser().exists():
        base, _, suffix = spec.rpartition("@")
        if base and _SPLIT.match(suffix):
            return base, suffix, True
    return spec, split, False


def looks_like_hub_name(spec: str) -> bool:
    """`org/name` that is not a local-looking path (no data-file suffix, no existing parent directory)."""
    if not _HUB_NAME.match(spec) or spec.startswith((".", "/", "~")):
        return False
    if spec.lower().endswith(FILE_SUFFIXES):
        return False
    return not Path(spec).expanduser().parent.is_dir()


# -- single files -------------------------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    """JSON lines split on newlines only: str.splitlines would also split on U+2028/U+2029/U+0085 and other
    separators that are valid unescaped inside a JSON string."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


#: Largest JSON line read as one record. No model context holds this much text (--max_len counts tokens), so a
#: bigger line is a concatenation or export mistake; refusing it names it instead of tokenising megabytes.
MAX_RECORD_CHARS = 4 * 2**20


def _read_jsonl_text(text: str, source: str) -> list[Any]:
    rows: list[Any] = []
    for lineno, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_CHARS:
            raise UserError(f"{source}: record {len(rows) + 1} (line {lineno}) is {len(line) / 2**20:.1f} MB of text; "
                            f"records over {MAX_RECORD_CHARS // 2**20} MB are refused (far beyond any --max_len): "
                            "split or trim it")
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{source}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
    return rows


def _read_json(path: Path, split: str) -> tuple[list[Any], bool]:
    """(rows, whether they are the named split of a {"<split>": [...]} document)."""
    text = _read_text(path)
    if not text.strip():
        return [], False
    try:
        data = json.loads(text)
    except json.JSONDecodeError as whole:
        # Not one JSON document: maybe JSON lines in a .json file. Report the more telling of the two errors.
        first_line = _lines(text.lstrip())[0]
        try:
            json.loads(first_line)
        except json.JSONDecodeError:
            raise UserError(f"{path}: not valid JSON at line {whole.lineno} ({whole.msg} at column "
                            f"{whole.colno})") from None
        return _read_jsonl_text(text, str(path)), False
    if isinstance(data, list):
        return data, False
    if isinstance(data, dict):
        if isinstance(data.get(split), list):
            return data[split], True
        if isinstance(data.get("data"), list):
            return data["data"], False
        if data and all(isinstance(v, list) for v in data.values()):
            raise UserError(f"{path}: no split '{split}' (it has {', '.join(map(str, data))}); pick one with "
                            f"{path}@<split>")
    found = f"an object with keys {sorted(data)[:10]}" if isinstance(data, dict) else f"a {type(data).__name__}"
    raise UserError(f"{path}: expected a JSON list of records, {{\"data\": [...]}} or JSON lines; found {found}")


def _load_json_file(path: Path) -> Any:
    """A small JSON metadata file (state.json, dataset_dict.json); corrupt is a user error."""
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark is allowed and dropped
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); is it really a JSON file?") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror or e}") from None


def _read_arrow_table(path: Path) -> Any:
    """An Arrow IPC file (random access) or stream (what `datasets` writes)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()


def _read_columnar(path: Path, kind: str) -> list[Any]:
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(str(path))
        elif kind == "csv":
            import pyarrow.csv as pcsv

            if path.stat().st_size == 0:
                return []
            table = pcsv.read_csv(str(path))
        else:
            table = _read_arrow_table(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path}: cannot read as {kind}: {first}") from None
    return table.to_pylist()


def read_file(path: Path, split: str = "train") -> list[Any]:
    """Rows of one local data file, chosen by its suffix."""
    return _read_file(path, split)[0]


def _read_file(path: Path, split: str) -> tuple[list[Any], bool]:
    """(rows, whether the file held several splits and `split` was picked from them)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl_text(_read_text(path), str(path)), False
    if suffix == ".json":
        return _read_json(path, split)
    if suffix in (".parquet", ".csv"):
        return _read_columnar(path, suffix[1:]), False
    if suffix in (".arrow", ".feather"):
        return _read_columnar(path, "arrow"), False
    raise UserError(f"{path}: unsupported file type '{suffix or path.name}'; {ACCEPTED}")


def _check_unsplit(spec: str, split: str, explicit: bool, arg_name: str, own_split: str | None = None) -> None:
    """A source that is one split (a file, a saved Dataset, a folder of unnamed files) accepts `@train`, or
    its own recorded split name; asking it for another split is a mistake, not a silent fallback."""
    if explicit and split != (own_split or "train"):
        raise UserError(f"{arg_name} {spec}@{split}: this source has no splits (it is a single "
                        f"{own_split or 'train'} split); drop '@{split}' or give per-split files")


# -- directories --------------------------------------------------------------------------------------------
def _read_saved_dataset(path: Path, split: str, arg_name: str, explicit: bool) -> tuple[list[Any], str]:
    """A `save_to_disk` directory; returns (rows, source name)."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = list(_load_json_file(path / "dataset_dict.json")["splits"])
        except (KeyError, TypeError):
            raise UserError(f"{path}/dataset_dict.json: not a datasets DatasetDict index") from None
        if split not in splits:
            raise UserError(f"{arg_name} {path}: no split '{split}' (it has {', '.join(splits)}); pick one with "
                            f"{path}@<split> or --dataset_split/--eval_split")
        path = path / split
    elif explicit:
        state = _load_json_file(path / "state.json") if (path / "state.json").is_file() else {}
        _check_unsplit(str(path), split, explicit, arg_name, state.get("_split") if isinstance(state, dict) else None)
    try:
        import datasets
    except ImportError:  # the data is plain Arrow: read the shards listed in state.json directly
        files = _load_json_file(path / "state.json").get("_data_files", [])
        return [row for f in files for row in _read_columnar(path / f["filename"], "arrow")], str(path)
    try:
        return datasets.load_from_disk(str(path)).to_list(), str(path)
    except Exception as e:  # noqa: BLE001 -- any failure inside datasets is a bad directory here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{arg_name} {path}: cannot load the saved dataset: {first}") from None


def _split_of(rel: Path) -> str | None:
    """The split a data file inside a directory belongs to, from its folder or file name; None if unnamed."""
    stem = rel.name.split(".")[0].lower()
    for name in SPLIT_NAMES:
        if any(part.lower() == name for part in rel.parts[:-1]):
            return name
        if stem == name or stem.startswith((name + "-", name + "_")):
            return name
    return None


def _read_data_dir(path: Path, split: str, arg_name: str, explicit: bool) -> list[Record]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise UserError(f"{arg_name} {path}: the directory holds no data files; {ACCEPTED}")
    by_split = {f: _split_of(f.relative_to(path)) for f in files}
    named = {s for s in by_split.values() if s is not None}
    if named:
        files = [f for f in files if by_split[f] == split.lower()]
        if not files:
            raise UserError(f"{arg_name} {path}: no data files for split '{split}' (found splits: "
                            f"{', '.join(sorted(named))}); pick one with {path}@<split>")
    else:
        _check_unsplit(str(path), split, explicit, arg_name)
    records: list[Record] = []
    for f in files:
        records.extend(as_records(read_file(f, split), str(f)))
    return records


# -- hub ----------------------------------------------------------------------------------------------------
def _read_hub(name: str, split: str, arg_name: str) -> list[Any]:
    try:
        import datasets

        return datasets.load_dataset(name, split=split).to_list()
    except Exception as e:  # noqa: BLE001 -- offline, unknown name, missing split: all user-facing
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"{arg_name} {name}: no such local path, and loading it as a hub dataset failed "
                        f"(hub unreachable or unknown name/split): {first}") from None


# -- entry point --------------------------------------------------------------------------------------------
def load_records(spec: str, split: str = "train", max_samples: int | None = None,
                 arg_name: str = "--dataset") -> list[Record]:
    """All records of one source (see the module docstring for the accepted forms), at most `max_samples`."""
    if not spec or not spec.strip():
        raise UserError(f"{arg_name} is empty; {ACCEPTED}")
    if max_samples is not None and max_samples < 1:
        raise UserError(f"--max_samples {max_samples} must be at least 1")
    spec, split, explicit_split = split_spec(spec.strip(), split)
    path = Path(spec).expanduser()
    if generated_tasks.is_generated(spec):
        records = as_records(generated_tasks.generated_records(spec, split, arg_name), f"{spec}@{split}")
    elif path.is_file():
        rows, picked_split = _read_file(path, split)
        if not picked_split:
            _check_unsplit(spec, split, explicit_split, arg_name)
        records = as_records(rows, str(path))
    elif path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            rows, source = _read_saved_dataset(path, split, arg_name, explicit_split)
            records = as_records(rows, source)
        else:
            records = _read_data_dir(path, split, arg_name, explicit_split)
    elif looks_like_hub_name(spec):
        records = as_records(_read_hub(spec, split, arg_name), f"{spec}@{split}")
    else:
        raise UserError(f"{arg_name} {spec}: no such file or directory; {ACCEPTED}")
    if not records:
        raise UserError(f"{arg_name} {spec}: has no records")
    return records[:max_samples] if max_samples is not None else records


# -- mixtures -----------------------------------------------------------------------------------------------
def parse_probs(probs: str, count: int, arg_name: str = "--dataset") -> list[float]:
    """`"0.3,0.7"` -> [0.3, 0.7], checked against the number of sources."""
    flag = f"{arg_name}_probs"
    try:
        values = [float(p) for p in probs.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"{flag} {probs!r}: expected comma-separated numbers like 0.3,0.7") from None
    if len(values) != count:
        raise UserError(f"{flag} {probs} has {len(values)} values but {arg_name} names {count} "
                        f"dataset{'s' if count != 1 else ''}; give one probability per dataset")
    if any(not v >= 0 for v in values):  # `not >=` also rejects nan
        raise UserError(f"{flag} {probs}: probabilities must be non-negative")
    if abs(sum(values) - 1.0) > 1e-6:
        raise UserError(f"{flag} {probs}: probabilities sum to {sum(values):g}, not 1")
    return values


def mixture_counts(probs: list[float], total: int) -> list[int]:
    """Largest-remainder rounding of probs[i] * total: integers that sum to exactly `total`."""
    quotas = [p * total for p in probs]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(probs)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def load_mixture(specs: str, probs: str | None = None, split: str = "train", max_samples: int | None = None,
                 seed: int = 42, arg_name: str = "--dataset") -> list[Record]:
    """Read comma-separated sources and mix them.

    One source: its records in file order, the first `max_samples` (probs, if given, must be "1").
    Several sources, the exact rule:
      1. every source is read in full: n_i records; total = min(sum n_i, max_samples);
      2. source i contributes count_i = probs[i] * total records, rounded by largest remainder so the counts
         sum to total exactly (no probs: probs[i] = n_i / sum n, i.e. plain concatenation when not capped);
      3. those count_i records are source i in a random order (torch.Generator seeded with `seed`), cycling
         through fresh random orders when count_i > n_i (so every record is used floor or ceil times);
      4. the mixture is shuffled with the same generator, so any prefix holds about the same proportions.
    The same seed gives the same mixture on every rank.
    """
    import torch

    names = [s.strip() for s in specs.split(",")] if not Path(specs).expanduser().exists() else [specs]
    names = [n for n in names if n]
    if not names:
        raise UserError(f"{arg_name} is empty; {ACCEPTED}")
    weights = parse_probs(probs, len(names), arg_name) if probs is not None else None
    if len(names) == 1:
        return load_records(names[0], split, max_samples, arg_name)
    if max_samples is not None and max_samples < 1:
        raise UserError(f"--max_samples {max_samples} must be at least 1")
    sources = [load_records(name, split, None, arg_name) for name in names]
    sizes = [len(s) for s in sources]
    total = sum(sizes) if max_samples is None else min(sum(sizes), max_samples)
    counts = mixture_counts(weights or [n / sum(sizes) for n in sizes], total)
    gen = torch.Generator().manual_seed(seed)
    mixed: list[Record] = []
    for records, count in zip(sources, counts):
        order: list[int] = []
        while len(order) < count:
            order.extend(torch.randperm(len(records), generator=gen).tolist())
        mixed.extend(records[i] for i in order[:count])
    return [mixed[i] for i in torch.randperm(len(mixed), generator=gen).tolist()]


def load_train_eval(data_args: Any, seed: int = 42) -> tuple[list[Record], list[Record] | None]:
    """(training records, evaluation records or None) from DataArgs: --dataset with --dataset_probs,
    --dataset_split, --max_samples; --eval_dataset with --eval_split."""
    a = data_args
    if not a.dataset:
        raise UserError(f"--dataset is required; {ACCEPTED}")
    train = load_mixture(a.dataset, a.dataset_probs, a.dataset_split, a.max_samples, seed, "--dataset")
    evaluation = load_mixture(a.eval_dataset, None, a.eval_split, None, seed, "--eval_dataset") \
        if a.eval_dataset else None
    return train, evaluation
