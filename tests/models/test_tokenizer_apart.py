"""`load_tokenizer_apart`: the Ray driver's tokenizer, chosen by AutoTokenizer in a forked child and sent back
pickled, is the tokenizer `load_tokenizer` gives; a user error in the child is raised as it is; and a driver that
prepares a Ray run (its inputs, its vLLM engines' arguments) never imports Transformers' modeling stack
(bench/results/ray_startup.md: about 150 MB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.errors import UserError
from rlhfkit.models import loading

CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture()
def forked(monkeypatch):
    """Take the fork path here, although this test process has imported AutoTokenizer's module already."""
    monkeypatch.setattr(loading, "_AUTO_TOKENIZER_MODULE", "rlhfkit_tests.never_imported")


def _summary(tok) -> dict:
    return {"class": type(tok).__name__, "ids": tok("Hello world, 12 + 30 = 42.")["input_ids"],
            "pad": tok.pad_token, "eos": tok.eos_token, "side": tok.padding_side, "len": len(tok),
            "special": tok.all_special_tokens, "template": tok.chat_template,
            "chat": tok.apply_chat_template(CHAT, tokenize=False) if tok.chat_template else None}


@pytest.mark.parametrize("which", ["demo", "vlm"])
def test_the_tokenizer_sent_back_is_the_one_autotokenizer_loads(forked, which, demo_assets, vlm_assets):
    path = str(demo_assets.model_dir if which == "demo" else vlm_assets.model_dir)
    apart = loading.load_tokenizer_apart(path, padding_side="left")
    here = loading.load_tokenizer(path, padding_side="left")
    assert _summary(apart) == _summary(here)
    assert apart.batch_decode(here(["a b c", "12 + 30"])["input_ids"]) == here.batch_decode(
        here(["a b c", "12 + 30"])["input_ids"])


def test_a_user_error_in_the_child_is_raised_here(forked, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=f"--pretrain {tmp_path}: cannot load"):
        loading.load_tokenizer_apart(str(tmp_path))


def test_a_child_that_dies_falls_back_to_loading_here(forked, monkeypatch, demo_assets):
    monkeypatch.setattr(loading, "_send_tokenizer", lambda send, path, kwargs: None)  # exits without answering
    tok = loading.load_tokenizer_apart(str(demo_assets.model_dir))
    assert tok("a b")["input_ids"] == loading.load_tokenizer(str(demo_assets.model_dir))("a b")["input_ids"]


def test_a_tokenizer_that_does_not_pickle_is_loaded_here(forked, monkeypatch, demo_assets):
    real = loading.load_tokenizer

    def unpicklable(path, **kwargs):
        tok = real(path, **kwargs)
        tok.handle = __import__("threading").Lock()  # a lock does not pickle
        return tok

    monkeypatch.setattr(loading, "load_tokenizer", unpicklable)
    tok = loading.load_tokenizer_apart(str(demo_assets.model_dir))
    assert hasattr(tok, "handle")  # loaded in this process, by the fall-back


DRIVER = """
import json, sys
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import engine_spec
from rlhfkit.rl.ray_run import prepare_ray_run
from rlhfkit.rollout.vllm_engine import VLLMEngineArgs
cfg = parse_config(PPOConfig, sys.argv[1:], "train_ppo_ray")
run = prepare_ray_run(cfg, use_gpu=False, cpus_per_bundle=1)
VLLMEngineArgs.from_spec(engine_spec(cfg), use_gpu=False)  # what the driver makes for its vLLM engines
heavy = ["transformers.models.auto.tokenization_auto", "transformers.modeling_utils", "transformers.generation",
         "torch._dynamo", "accelerate"]
print(json.dumps({"imported": [m for m in heavy if m in sys.modules], "prompts": len(run.inputs.prompts),
                  "tokenizer": type(run.inputs.tokenizer).__name__}))
run.inputs.close()
"""


@pytest.mark.parametrize("teacher", [False, True])
def test_a_ray_driver_prepares_its_run_without_the_modeling_stack(demo_assets, tmp_path, teacher):
    """With --teacher_pretrain the driver also checks the teacher's tokenizer against the student's."""
    argv = ["--pretrain", str(demo_assets.model_dir), "--prompt_data", str(demo_assets.rl_train),
            "--input_key", "prompt", "--label_key", "answer", "--remote_rm_url",
            str(Path(__file__).parents[2] / "rlhfkit/demo/reward_func.py"), "--vllm_num_engines", "0",
            "--colocate_all_models", "--actor_num_gpus_per_node", "1", "--rollout_batch_size", "4",
            "--micro_rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "4",
            "--save_path", str(tmp_path / "out"),
            *(["--teacher_pretrain", str(demo_assets.model_dir)] if teacher else [])]
    proc = subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imported"] == [] and out["prompts"] > 0
    assert out["tokenizer"] == type(loading.load_tokenizer(str(demo_assets.model_dir))).__name__
