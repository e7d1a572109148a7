"""The demo asset build: layout, offline reload, determinism, caching, schemas and split disjointness."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from rlhfkit.demo.assets import DemoAssets, build_demo_assets
from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE, is_correct
from rlhfkit.errors import UserError

SMALL = dict(n_sft=40, n_eval=10, n_pref=20, n_pref_eval=5, n_rl=20, n_rl_eval=10)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_and_manifest(demo_assets: DemoAssets):
    for path in [demo_assets.model_dir / "config.json", demo_assets.model_dir / "model.safetensors",
                 demo_assets.model_dir / "generation_config.json", demo_assets.model_dir / "tokenizer.json",
                 demo_assets.tokenizer_dir / "tokenizer.json", *demo_assets.data_files().values()]:
        assert path.is_file(), path
    manifest = json.loads(demo_assets.manifest.read_text())
    assert manifest["seed"] == 0 and manifest["input_template"] == DEMO_INPUT_TEMPLATE
    assert manifest["counts"] == {"sft_train": 4000, "sft_eval": 200, "pref_train": 2000, "pref_eval": 200,
                                  "kto_train": 4000, "kto_eval": 400, "rl_train": 2000, "rl_eval": 200}
    assert set(manifest["versions"]) >= {"python", "torch", "transformers", "tokenizers"}
    assert 0.8e6 < manifest["n_params"] < 1.6e6


def test_model_and_tokenizer_reload_offline_from_one_directory(demo_assets, demo_model, demo_tokenizer):
    cfg = demo_model.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 4, 2)
    assert cfg.max_position_embeddings == 512 and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(demo_tokenizer) == 2048
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    gen = demo_model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)
    assert demo_model.lm_head.weight.data_ptr() == demo_model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1] + demo_tokenizer("What is 2+2?")["input_ids"]])
    logits = demo_model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 2048) and torch.isfinite(logits).all()
    from transformers import AutoTokenizer

    alone = AutoTokenizer.from_pretrained(demo_assets.tokenizer_dir)
    assert alone.backend_tokenizer.to_str() == demo_tokenizer.backend_tokenizer.to_str()


def test_same_seed_gives_identical_files(demo_assets, tmp_path):
    again = build_demo_assets(tmp_path / "again", seed=0)
    assert _digests(again.root) == _digests(demo_assets.root)


def test_another_seed_gives_other_weights_and_data(demo_assets, tmp_path):
    other = build_demo_assets(tmp_path / "other", seed=1, **SMALL)
    first = [r["question"] for r in demo_assets.read("sft_train")[:10]]
    assert [r["question"] for r in other.read("sft_train")[:10]] != first
    a = (demo_assets.model_dir / "model.safetensors").read_bytes()
    assert (other.model_dir / "model.safetensors").read_bytes() != a


def test_second_call_reuses_and_changed_arguments_rebuild(tmp_path):
    first = build_demo_assets(tmp_path / "a", seed=0, **SMALL)
    stamp = first.manifest.stat().st_mtime_ns
    assert build_demo_assets(tmp_path / "a", seed=0, **SMALL) == first
    assert first.manifest.stat().st_mtime_ns == stamp
    rebuilt = build_demo_assets(tmp_path / "a", seed=0, **dict(SMALL, n_sft=30))
    assert len(rebuilt.read("sft_train")) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp or old directories left behind


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        build_demo_assets(tmp_path / "mine", **SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        build_demo_assets(tmp_path / "file", **SMALL)
    with pytest.raises(UserError, match="unknown task"):
        build_demo_assets(tmp_path / "new", task_mix={"division": 1.0}, **SMALL)
    with pytest.raises(UserError, match="ran out"):
        # 1-2 digit addition has 100 x 100 distinct prompts
        build_demo_assets(tmp_path / "new", task_mix={"addition": 1.0}, n_sft=10_001, n_eval=0, n_pref=0,
                          n_pref_eval=0, n_rl=0, n_rl_eval=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]  # nothing half-built left


def test_record_schemas(demo_assets):
    sft = demo_assets.read("sft_train")[0]
    assert set(sft) == {"question", "response", "task", "messages"}
    assert sft["messages"] == [{"role": "user", "content": sft["question"]},
                               {"role": "assistant", "content": sft["response"]}]
    for pair in demo_assets.read("pref_train"):
        assert set(pair) == {"prompt", "chosen", "rejected", "task", "chosen_messages", "rejected_messages"}
        assert pair["chosen_messages"][1]["content"] == pair["chosen"]
        assert pair["rejected_messages"][0]["content"] == pair["prompt"]
        assert not is_correct(pair["rejected"], pair["chosen"])
    kto = demo_assets.read("kto_train")
    assert set(kto[0]) == {"prompt", "completion", "label", "task"}
    assert sum(r["label"] for r in kto) == len(kto) // 2
    rl = demo_assets.read("rl_eval")[0]
    assert set(rl) == {"prompt", "answer", "task"}


def test_answers_are_right(demo_assets):
    for record in demo_assets.read("sft_train") + demo_assets.read("sft_eval"):
        if record["task"] == "addition":
            a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", record["question"]).groups())
            assert record["response"] == str(a + b)
    for record in demo_assets.read("rl_train"):
        if record["task"] == "reverse":
            number = re.fullmatch(r"Reverse the digits of (\d+)\.", record["prompt"]).group(1)
            assert record["answer"] == number[::-1]


def test_mostly_addition(demo_assets):
    for split in ("sft_train", "rl_train", "rl_eval"):
        records = demo_assets.read(split)
        share = sum(r["task"] == "addition" for r in records) / len(records)
        assert 0.62 < share < 0.78, (split, share)
        assert {r["task"] for r in records} == {"addition", "reverse", "max", "count"}


def test_eval_prompts_are_held_out(demo_assets):
    def prompts(split: str) -> list[str]:
        return [r.get("prompt", r.get("question")) for r in demo_assets.read(split)]

    train = {split: prompts(split) for split in ("sft_train", "pref_train", "rl_train")}
    evals = {split: prompts(split) for split in ("sft_eval", "pref_eval", "rl_eval")}
    for split, ps in {**train, **evals}.items():
        assert len(set(ps)) == len(ps), f"repeated prompts in {split}"
    all_eval = [p for ps in evals.values() for p in ps]
    assert len(set(all_eval)) == len(all_eval)  # eval splits are disjoint from each other
    for ps in train.values():
        assert not set(ps) & set(all_eval)
    assert {r["prompt"] for r in demo_assets.read("kto_eval")} == set(evals["pref_eval"])
