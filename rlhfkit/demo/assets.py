"""Write the offline demo assets to a directory: tokenizer, a random-init tiny Llama, and the data sets.

Layout of `out_dir`:
    model/       LlamaForCausalLM (safetensors) saved together with the tokenizer: `--pretrain out_dir/model`
    tokenizer/   the tokenizer alone
    data/        sft_{train,eval}.jsonl, pref_{train,eval}.jsonl, kto_{train,eval}.jsonl, rl_{train,eval}.jsonl
    manifest.json  seed, sizes, record counts and library versions

Everything follows from the random seed. A second call with the same directory and arguments reuses the files (the
manifest must match, library versions included); otherwise the directory is rebuilt. The build goes to a
temporary sibling directory that is renamed into place, so a crash never leaves a half-written asset set.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.demo.data import build_all_records
from rlhfkit.demo.tasks import DEFAULT_TASK_MIX, DEMO_INPUT_TEMPLATE, TASKS
from rlhfkit.errors import UserError

__all__ = ["ASSETS_FORMAT", "DEMO_INPUT_TEMPLATE", "DemoAssets", "build_demo_assets", "tiny_llama_config",
           "write_jsonl"]

ASSETS_FORMAT = 2  # bump when the layout or the generators change, so old caches are rebuilt
DATA_SPLITS = ("sft_train", "sft_eval", "pref_train", "pref_eval", "kto_train", "kto_eval",
               "rl_train", "rl_eval")


@dataclass(frozen=True)
class DemoAssets:
    """Paths of one built asset set (see the module docstring for the layout)."""

    root: Path
    model_dir: Path
    tokenizer_dir: Path
    data_dir: Path
    sft_train: Path
    sft_eval: Path
    pref_train: Path
    pref_eval: Path
    kto_train: Path
    kto_eval: Path
    rl_train: Path
    rl_eval: Path
    manifest: Path

    @classmethod
    def at(cls, root: str | os.PathLike) -> DemoAssets:
        """The paths under `root` (whether or not they exist yet)."""
        root = Path(root)
        data = root / "data"
        return cls(root=root, model_dir=root / "model", tokenizer_dir=root / "tokenizer", data_dir=data,
                   manifest=root / "manifest.json", **{s: data / f"{s}.jsonl" for s in DATA_SPLITS})

    def data_files(self) -> dict[str, Path]:
        return {split: getattr(self, split) for split in DATA_SPLITS}

    def read(self, split: str) -> list[dict]:
        """The records of one data split, e.g. `assets.read("rl_eval")`."""
        with open(self.data_files()[split], encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def tiny_llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int, **overrides):
    """The demo model's shape: hidden 128, 4 layers, 4 heads (2 KV), tied embeddings, about 1M parameters.

    `initializer_range` is 0.06, not Llama's 0.02: measured on demo addition SFT (batch 32, lr 1e-3), the
    wider init reached 0.36-0.46 exact match after 400 steps where 0.02 reached 0.02-0.09 (0.02 needed
    about 1,200 steps to pass 0.5).
    """
    from transformers import LlamaConfig

    shape: dict[str, Any] = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                 rms_norm_eps=1e-5, initializer_range=0.06)
    shape.update(overrides)
    return LlamaConfig(vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, **shape)


def _versions() -> dict[str, str]:
    """Versions that change what a build writes; read from package metadata (importing torch takes seconds)."""
    import rlhfkit

    versions = {"rlhfkit": rlhfkit.__version__, "python": platform.python_version()}
    for package in ("torch", "transformers", "tokenizers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def write_jsonl(path: Path, records: Iterable[Mapping]) -> int:
    """Write `records` one JSON object per line; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def _write_model(model_dir: Path, tokenizer, seed: int) -> int:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = tiny_llama_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                               tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-file "Writing model shards" bar is noise in a CLI
    try:
        model.save_pretrained(model_dir)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def _build_into(tmp: Path, key: dict) -> None:
    from rlhfkit.demo.tokenizer import build_tokenizer

    paths = DemoAssets.at(tmp)
    records = build_all_records(key["seed"], key["sizes"], key["task_mix"])  # first: it is cheap and can fail
    tokenizer = build_tokenizer(seed=key["seed"], vocab_size=key["vocab_size"])
    tokenizer.save_pretrained(paths.tokenizer_dir)
    n_params = _write_model(paths.model_dir, tokenizer, key["seed"])
    paths.data_dir.mkdir(parents=True)
    counts = {split: write_jsonl(path, records[split]) for split, path in paths.data_files().items()}
    manifest = dict(key, counts=counts, n_params=n_params, vocab=len(tokenizer),
                    input_template=DEMO_INPUT_TEMPLATE)
    # Written last: a directory with a manifest is a complete one.
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _cached(paths: DemoAssets, key: dict) -> bool:
    """True when `paths.root` holds a complete build made with exactly `key`."""
    try:
        manifest = json.loads(paths.manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if any(manifest.get(k) != v for k, v in key.items()):
        return False
    needed = [paths.model_dir / "config.json", paths.model_dir / "model.safetensors",
              paths.model_dir / "tokenizer.json", paths.tokenizer_dir / "tokenizer.json",
              *paths.data_files().values()]
    return all(p.is_file() for p in needed)


def build_demo_assets(out_dir: str | os.PathLike, seed: int = 0, n_sft: int = 4000, n_eval: int = 200,
                      n_pref: int = 2000, n_pref_eval: int = 200, n_rl: int = 2000, n_rl_eval: int = 200,
                      vocab_size: int = 2048, task_mix: Mapping[str, float] | None = None,
                      force: bool = False) -> DemoAssets:
    """Build (or reuse) the demo assets under `out_dir` and return their paths.

    `n_sft`/`n_eval`: SFT train/eval records; `n_pref`/`n_pref_eval`: preference pairs (the KTO files hold
    both sides of each pair, so twice as many records); `n_rl`/`n_rl_eval`: RL prompts. `task_mix` maps task
    name to probability (default: 70% addition). `force` rebuilds even when a matching build exists.
    """
    sizes = {"sft_train": n_sft, "sft_eval": n_eval, "pref_train": n_pref, "pref_eval": n_pref_eval,
             "rl_train": n_rl, "rl_eval": n_rl_eval}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 0}
    if bad:
        raise UserError(f"demo assets: sizes must be non-negative integers, got {bad}")
    mix = dict(DEFAULT_TASK_MIX if task_mix is None else task_mix)
    if not mix or any(p < 0 for p in mix.values()) or sum(mix.values()) <= 0:
        raise UserError(f"demo assets: task_mix needs non-negative weights with a positive sum, got {mix}")
    unknown = sorted(set(mix) - set(TASKS))
    if unknown:
        raise UserError(f"demo assets: unknown task(s) {unknown} in task_mix; known: {', '.join(TASKS)}")
    key = {"format": ASSETS_FORMAT, "seed": int(seed), "vocab_size": int(vocab_size), "sizes": sizes,
           "task_mix": {k: mix[k] for k in sorted(mix)}, "versions": _versions()}

    paths = DemoAssets.at(Path(out_dir).expanduser().resolve())
    root = paths.root
    if root.exists() and not root.is_dir():
        raise UserError(f"demo assets: {root} is a file; give a directory to write the assets to")
    if not force and _cached(paths, key):
        return paths
    if root.is_dir() and any(root.iterdir()) and not paths.manifest.exists():
        raise UserError(f"demo assets: {root} is not empty and holds no demo manifest.json; refusing to "
                        "overwrite it, give a new or empty directory")
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    except OSError as e:
        raise UserError(f"demo assets: cannot write next to {root}: {e.strerror or e}") from None
    try:
        try:
            _build_into(tmp, key)
        except ValueError as e:  # e.g. more records asked for than there are distinct prompts
            raise UserError(f"demo assets: {e}") from None
        _move_into_place(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _cached(paths, key):  # another process won the race with a different build
        raise UserError(f"demo assets: {root} changed while building; run again")
    return paths


def _move_into_place(tmp: Path, root: Path) -> None:
    """Rename `tmp` to `root`, replacing an older (or empty) build that sits there."""
    old = None
    if root.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
        os.rename(root, old / "assets")
    try:
        os.rename(tmp, root)
    except OSError:
        # A concurrent build landed first; keep that one (the caller checks it matches).
        if not root.exists():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_preference_assets(out_dir: str | os.PathLike, seed: int = 0) -> DemoAssets:
    """Assets restricted to the `max` task with 1,536 preference pairs: the preference stages use these.

    On the default mix (mostly addition) telling a right sum from a wrong one needs arithmetic the raw
    1M-parameter model does not have, so held-out pairwise accuracy plateaus near 0.65; `max` pairs are
    learnable within a few dozen steps."""
    return build_demo_assets(out_dir, seed=seed, task_mix={"max": 1.0}, n_sft=8, n_eval=8, n_pref=1536,
                             n_pref_eval=200, n_rl=8, n_rl_eval=8)
