"""`--dry_run`: the layouts of two of OpenRLHF's example commands (7B hybrid engine on 8 GPUs, 70B on the 8-node
layout) planned from a CPU machine with synthetic Llama-2 config.json files, the printed estimates checked
(docs/memory-planner.md shows the same output), advice when a plan does not fit, and that a dry run loads no model
(the model directories hold only config.json)."""

from __future__ import annotations

import re

import pytest

from rlhfkit.cli import train_dpo, train_ppo_ray, train_sft
from rlhfkit.cli.common import run_cli
from tests.cli.test_seed_commands import BLOCKS, SEEDS
from tests.helpers import REPO
from tests.planner.memory_shapes import LLAMA2_7B, LLAMA2_70B, write_config

pytestmark = pytest.mark.skipif(SEEDS is None, reason="OpenRLHF's examples (../shared/seeds) are not on this machine")

SEED_7B_HYBRID = "001-0-train_ppo_ray"  # "PPO Training (Hybrid Engine)": 8 GPUs, --colocate_all_models, both sleeps
SEED_70B_MULTINODE = "001-10-train_ppo_ray"  # "8-node cluster (64 GPUs) - 70B model"


def seed_argv(block_id: str, model: str, gpu_gb: str = "80") -> list[str]:
    """OpenRLHF's block flags with the model paths pointing at a config.json-only directory, a prompt file name
    where the block has none (it is not read), and --dry_run for GPUs of `gpu_gb`."""
    argv = list(next(b for b in BLOCKS if b.id == block_id).argv)
    for flag in ("--pretrain", "--reward_pretrain"):
        if flag in argv:
            argv[argv.index(flag) + 1] = model
    if "--prompt_data" not in argv:
        argv += ["--prompt_data", "prompts.jsonl"]
    return argv + ["--dry_run", "--dry_run_gpu_memory_gb", gpu_gb]


def dry_run(capsys, main, argv: list[str]) -> str:
    code = run_cli(main, argv, prog="x")
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative model paths: the printed plan is the docs page's, byte for byte
    write_config(tmp_path / "Llama-2-7b-hf", LLAMA2_7B)
    write_config(tmp_path / "Llama-2-70b-hf", LLAMA2_70B)


def docs_block(title: str) -> str:
    text = (REPO / "docs" / "memory-planner.md").read_text(encoding="utf-8")
    match = re.search(re.escape(title) + r".*?```text\n(.*?)```", text, re.S)
    assert match, f"docs/memory-planner.md has no ```text block after {title!r}"
    return match.group(1)


def test_seed_7b_hybrid_engine_on_8_gpus(capsys, models):
    out = dry_run(capsys, train_ppo_ray.main, seed_argv(SEED_7B_HYBRID, "Llama-2-7b-hf"))
    # 6.738B params; ZeRO-3 over 8: weights and gradients 6.738e9 x 2 / 8 = 1.57 GiB, Adam 12 x / 8 = 9.41 GiB
    assert re.search(r"actor +weights +train +1\.57 GiB", out)
    assert re.search(r"actor +optimizer states +train +9\.41 GiB", out)
    # vLLM: 0.5 x 80 GiB reserved per GPU, its weights 6.738e9 x 2 / TP 2 = 6.28 GiB
    assert re.search(r"vllm +weights +generate +6\.28 GiB", out)
    assert "peak: resident 0.0 MiB + max(generate 40.00 GiB, train 25.01 GiB) = 40.00 GiB of 80.00 GiB" in out
    assert "verdict: FITS: largest per-device peak 40.00 GiB of 80.00 GiB" in out
    assert out == docs_block("7B, hybrid engine on 8 GPUs")


def test_seed_70b_on_the_multi_node_layout(capsys, models):
    out = dry_run(capsys, train_ppo_ray.main, seed_argv(SEED_70B_MULTINODE, "Llama-2-70b-hf"))
    # 68.98B params, ZeRO-3 over 16: 16 bytes x 68.98e9 / 16 = 64.24 GiB of states per actor GPU
    assert "peak: resident 64.24 GiB + max(generate 0.0 MiB, train 3.93 GiB) = 68.17 GiB of 80.00 GiB" in out
    # vLLM takes OpenRLHF's --vllm_gpu_memory_utilization 0.95 of each GPU: 76 GiB, under 10% headroom
    assert "verdict: FITS, TIGHT (under 10% headroom): largest per-device peak 76.00 GiB of 80.00 GiB (pool vllm)" \
        in out
    assert out == docs_block("70B on the 8-node layout")


def test_a_plan_that_does_not_fit_says_what_to_change(capsys, models):
    out = dry_run(capsys, train_ppo_ray.main, seed_argv(SEED_7B_HYBRID, "Llama-2-7b-hf", gpu_gb="24"))
    assert "verdict: DOES NOT FIT: largest per-device peak 25.01 GiB of 24.00 GiB" in out
    assert "--adam_offload: peak 25.01 GiB -> 15.59 GiB (fits)" in out
    assert "--micro_train_batch_size 4: peak 25.01 GiB -> 18.78 GiB (fits)" in out
    # 70B on 24 GiB GPUs: vLLM's share of the weights (32 GiB at TP 4) exceeds its 0.9 x 24 GiB
    out = dry_run(capsys, train_ppo_ray.main, seed_argv(SEED_70B_MULTINODE, "Llama-2-70b-hf", gpu_gb="24"))
    assert "problem: vLLM:" in out and "vLLM will not start" in out and "DOES NOT FIT" in out


def test_trainers_plan_from_config_json_alone(capsys, tmp_path):
    model = write_config(tmp_path / "m", LLAMA2_7B)  # no weights, no tokenizer: a dry run loads neither
    common = ["--pretrain", str(model), "--dataset", "d.jsonl", "--bf16", "--zero_stage", "3", "--dry_run",
              "--dry_run_gpu_memory_gb", "80", "--dry_run_num_gpus", "8", "--micro_train_batch_size", "1"]
    out = dry_run(capsys, train_sft.main, common)
    assert "8 GPUs of 80.00 GiB" in out and re.search(r"model +optimizer states +resident +9\.41 GiB", out)
    out = dry_run(capsys, train_dpo.main, common + ["--ref_offload"])
    assert re.search(r"reference +weights \(offloaded\) +host RAM +1\.57 GiB", out)
    assert run_cli(train_sft.main, ["--pretrain", str(model), "--dry_run_gpu_memory_gb", "80"], prog="x") == 2
    assert "only apply with --dry_run" in capsys.readouterr().err
    assert run_cli(train_sft.main, ["--pretrain", str(tmp_path), "--dry_run"], prog="x") == 2
    assert "config.json" in capsys.readouterr().err


def test_pool_peak_phases_by_hand():
    """resident + max(generate, train); activations add as a maximum; with --deepspeed_enable_sleep (turns) the
    train phase is the largest single role."""
    from rlhfkit.planner.plan import Pool, Row

    rows = [Row("vllm", "reserved", "generate", 40.0), Row("actor", "states", "train", 12.0),
            Row("actor", "activations", "train", 10.0, transient=True), Row("critic", "states", "train", 11.0),
            Row("critic", "activations", "train", 6.0, transient=True), Row("x", "context", "resident", 1.0),
            Row("ref", "weights (offloaded)", "host RAM", 99.0)]
    shared = Pool("hybrid", 8, ["actor", "critic", "vllm"], rows)
    assert shared.phase_bytes("train") == 12 + 11 + max(10, 6)
    assert shared.peak == 1 + max(40, 33)
    turns = Pool("hybrid", 8, ["actor", "critic", "vllm"], rows, turns=True)
    assert turns.phase_bytes("train") == max(12 + 10, 11 + 6)
    rows[0].bytes = 20.0
    assert shared.peak == 1 + 33 and turns.peak == 1 + 22


def test_every_trainer_plans_lora_and_offload(capsys, tmp_path):
    """train_rm and train_kto plan too; LoRA trains only the adapters (gradients and Adam states of r x (in + out)
    per linear layer), QLoRA keeps NF4 base weights; --adam_offload moves the optimizer states to host RAM."""
    from rlhfkit.cli import train_kto, train_rm
    from rlhfkit.planner import memory as mem

    model = write_config(tmp_path / "m", LLAMA2_7B)
    common = ["--pretrain", str(model), "--dataset", "d.jsonl", "--bf16", "--dry_run", "--dry_run_gpu_memory_gb", "80"]
    out = dry_run(capsys, train_rm.main, common + ["--adam_offload"])
    # reward model: 6.738B - LM head + value head, 12 bytes each, on the host
    host = 12 * (6_738_415_616 - 32000 * 4096 + 4097)
    assert re.search(rf"model +optimizer states \(host RAM\) +host RAM +{host / mem.GIB:.2f} GiB", out)
    out = dry_run(capsys, train_kto.main, common + ["--lora_rank", "8"])
    lora = 32 * 8 * (4 * 8192 + 3 * (4096 + 11008))
    assert re.search(rf"model +gradients +resident +{2 * lora / mem.MIB:.1f} MiB +LoRA only", out)
    assert re.search(r"reference +weights +resident +12\.55 GiB", out)
    out = dry_run(capsys, train_sft.main, common + ["--lora_rank", "8", "--load_in_4bit"])
    assert re.search(rf"model +weights +resident +{mem.qlora_weights(6_738_415_616, lora) / mem.GIB:.2f} GiB", out)


def test_cpu_ray_plan_counts_a_process_per_rank(capsys, demo_assets):
    """train_ppo_ray on CPU: every rank is a process with its own baseline, plus the local Ray cluster."""
    argv = ["--pretrain", str(demo_assets.model_dir), "--prompt_data", str(demo_assets.rl_train), "--input_key",
            "prompt", "--remote_rm_url", str(REPO / "tests" / "distributed" / "reward_exact_match.py"),
            "--advantage_estimator", "group_norm", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4",
            "--actor_num_gpus_per_node", "2", "--dry_run"]
    out = dry_run(capsys, train_ppo_ray.main, argv)
    # actor x 2 ranks, ref x 1, the Transformers engine x 1
    assert re.search(r"process +Python \+ torch \+ transformers +resident +410\.0 MiB +1 process", out)
    assert re.search(r"process +Python \+ torch \+ transformers +resident +820\.0 MiB +2 processes", out)
    assert re.search(r"ray +local Ray cluster +resident +512\.0 MiB", out)
    assert "the largest process peaks at" in out
