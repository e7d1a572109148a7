"""vLLM's CPU KV cache is sized from the run: the engine arguments and the `--dry_run` planner give the same figure,
and the user's VLLM_CPU_KVCACHE_SPACE still wins in the planner (vLLM itself applies it over the engine argument).
No Ray, no vLLM import: the engines' own block count is checked in test_vllm_engine.py."""

from __future__ import annotations

import re

from rlhfkit.cli import train_ppo_ray
from rlhfkit.cli.common import run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import engine_spec
from rlhfkit.planner.memory import MIB
from rlhfkit.rollout.vllm_engine import VLLMEngineArgs


def argv(model_dir) -> list[str]:
    # the bench's GRPO workload: 16 prompts x 8 samples of at most 64 + 32 + 1 = 97 tokens
    return ["--pretrain", str(model_dir), "--prompt_data", "prompts.jsonl", "--vllm_num_engines", "1",
            "--rollout_batch_size", "16", "--n_samples_per_prompt", "8", "--micro_rollout_batch_size", "8",
            "--train_batch_size", "128", "--micro_train_batch_size", "8", "--prompt_max_len", "64",
            "--generate_max_len", "32", "--advantage_estimator", "group_norm", "--remote_rm_url",
            "rlhfkit/demo/reward_func.py"]


def test_engine_and_planner_size_the_cpu_kv_cache_alike(demo_assets, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    spec = engine_spec(parse_config(PPOConfig, argv(demo_assets.model_dir), "x"))
    assert spec.generate_batch == 128
    # the demo model: 2 KiB of KV a token (fp32), 128 sequences of one 128-token block: 32 MiB x 1.25 + 2 blocks
    assert VLLMEngineArgs.from_spec(spec, use_gpu=False).kv_cache_memory_bytes == 41 * MIB
    assert VLLMEngineArgs.from_spec(spec, use_gpu=True).kv_cache_memory_bytes is None  # GPUs: utilization sizes it
    # --eval_dataset: all its prompts x samples go in one call, so as many as vLLM runs at once (256): 81 MiB
    with_eval = engine_spec(parse_config(PPOConfig, argv(demo_assets.model_dir) + ["--eval_dataset", "e.jsonl"], "x"))
    assert with_eval.generate_batch == 0
    assert VLLMEngineArgs.from_spec(with_eval, use_gpu=False).kv_cache_memory_bytes == 81 * MIB
    assert run_cli(train_ppo_ray.main, argv(demo_assets.model_dir) + ["--dry_run"], prog="x") == 0
    out = capsys.readouterr().out
    assert re.search(r"vllm +KV cache +\w+ +41\.0 MiB +sized for 128 x 97 tokens", out), out
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert run_cli(train_ppo_ray.main, argv(demo_assets.model_dir) + ["--dry_run"], prog="x") == 0
    assert re.search(r"vllm +KV cache +\w+ +2\.00 GiB +VLLM_CPU_KVCACHE_SPACE=2 GiB", capsys.readouterr().out)


def test_the_context_limit_is_read_as_autoconfig_reads_it(demo_assets, tmp_path):
    """From config.json where it names the limit (the Ray driver then never imports Transformers' generation code),
    else from AutoConfig: the class default, or a key the class maps (GPT-2's n_positions)."""
    import json

    from transformers import AutoConfig

    from rlhfkit.rollout.vllm_engine import max_position_embeddings

    model = str(demo_assets.model_dir)
    assert max_position_embeddings(model) == AutoConfig.from_pretrained(model).max_position_embeddings == 512
    for name, config, expected in (("llama", {"model_type": "llama"}, 2048),
                                   ("gpt2", {"model_type": "gpt2", "n_positions": 64}, 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert max_position_embeddings(str(tmp_path / name)) == expected
