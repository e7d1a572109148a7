"""The planner's FSDP2, sequence- and tensor-parallel terms (rlhfkit/planner/parallel.py) against numbers computed
by hand for a small shape, and `--dry_run` with them: the rows it prints and the --ring_attn_size advice."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfkit.cli import train_sft
from rlhfkit.cli.common import run_cli
from rlhfkit.planner import memory as mem
from rlhfkit.planner import parallel as par
from tests.planner.memory_shapes import LLAMA2_7B, write_config

# vocab 1000, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, tied: by hand, a layer is
# q,o 64x64 x2 = 8192 + k,v 64x32 x2 = 4096 + MLP 3x64x128 = 24576 + norms 128 = 36992 parameters; the model
# embed 64000 + 2 layers 73984 + final norm 64 = 138048; its projections 2 x 36864 = 73728; its root 64064.
S = mem.ModelShape(1000, 64, 128, 2, 4, 2, 16, True)


def test_parameter_splits_by_hand():
    assert S.params() == 138048 and S.hidden_matrix_params() == 73728
    assert par.root_params(S) == 64064
    assert par.tp_params(S, 2) == 138048 - 73728 + 36864 == 101184


def test_fsdp2_states_by_hand():
    st = par.fsdp2_states(S, par.Layout("fsdp2", world=4), bf16=False)
    # fp32 shards over 4 ranks: 4 + 4 + 8 bytes per parameter / 4
    assert (st.weights, st.gradients, st.optimizer) == (138048, 138048, 276096) and not st.host
    # root + 2 layers gathered, root + 1 layer of unsharded gradients, 4 bytes each
    assert st.gathered == (64064 + 2 * 36992) * 4 + (64064 + 36992) * 4 == 956416
    bf16 = par.fsdp2_states(S, par.Layout("fsdp2", world=4), bf16=True)
    assert bf16.weights == 138048 and bf16.gathered == 956416 / 2  # shards stay fp32, the gathered copy is bf16
    frozen = par.fsdp2_states(S, par.Layout("fsdp2", world=2), bf16=True, trained=False)
    assert (frozen.weights, frozen.gradients, frozen.optimizer) == (138048, 0, 0)
    assert frozen.gathered == (64064 + 36992) * 2
    assert par.fsdp2_states(S, par.Layout("fsdp2", world=4), bf16=False, offload=True).host
    lora = par.fsdp2_states(S, par.Layout("fsdp2", world=2), bf16=False, lora=1000)
    assert (lora.weights, lora.gradients, lora.optimizer) == (138048 * 2, 2000, 4000)


def test_tensor_parallel_by_hand():
    st = par.fsdp2_states(S, par.Layout("fsdp2", world=4, tp=2), bf16=False)
    assert st.weights == 101184 * 4 / 2  # FSDP2 shards over world / TP = 2
    # a layer keeps 8h + 2kv + 4i + heads = 512 + 64 + 512 + 4 = 1092 per token; 4h stay whole, the rest halves
    assert par.tp_layer_elements(S, 8, 2) == 256 + (1092 - 256) / 2 == 674


def test_sequence_parallel_activations_by_hand():
    assert par.ulysses_extra_elements(S, 2) == 2 * (64 - 32) and par.ulysses_extra_elements(S, 1) == 0
    act = par.parallel_train_activations(S, 2, 8, False, False, par.Layout(sp=2))
    # 2 x 8 tokens / 2 = 8 per rank; (1092 + 64) x 8 x 4 bytes per layer, 2 layers; logits 8 x 1000 x 4 x 3
    assert (act.local_tokens, act.layers, act.logits) == (8, 2 * 1156 * 8 * 4, 96000)


@pytest.mark.parametrize("ckpt", [False, True])
def test_one_rank_layout_is_the_plain_estimate(ckpt):
    act = par.parallel_train_activations(S, 3, 40, True, ckpt, par.Layout())
    assert act.total == pytest.approx(mem.train_activations(S, 3, 40, True, ckpt), rel=1e-12)


def dry_run(capsys, argv: list[str]) -> str:
    code = run_cli(train_sft.main, argv, prog="x")
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_dry_run_fsdp2_and_ring_advice(capsys, tmp_path):
    """Llama-2-7B shape, 32k tokens per sample on 4 GPUs of 48 GB under FSDP2: with the whole sample on each rank
    it does not fit; the advice finds that --ring_attn_size 4 does, and planning that layout says it fits."""
    model = str(write_config(tmp_path / "l7", {**LLAMA2_7B, "max_position_embeddings": 32768}))
    argv = ["--pretrain", model, "--dataset", "d.jsonl", "--max_len", "32768", "--micro_train_batch_size", "1",
            "--train_batch_size", "4", "--backend", "fsdp2", "--bf16", "--gradient_checkpointing", "--dry_run",
            "--dry_run_gpu_memory_gb", "48", "--dry_run_num_gpus", "4"]
    out = dry_run(capsys, argv)
    assert "FSDP2" in out and "fp32 shards, FSDP2 over 4" in out and "gathered parameters" in out
    assert "verdict: DOES NOT FIT" in out
    assert any(line.strip().startswith("--ring_attn_size 4:") and line.endswith("(fits)")
               for line in out.splitlines()), out
    out = dry_run(capsys, [*argv, "--ring_attn_size", "4"])
    assert "ring 4" in out and "/ ring 4" in out and "verdict: FITS" in out


# the demo model's shape (rlhfkit/demo/assets.py) with room for 32k positions: bench/planner_parallel.py --long
DEMO_32K = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
            "max_position_embeddings": 32768}


def test_32k_sample_needs_the_ring_within_the_budget(capsys, tmp_path):
    """Issue 20 acceptance 3's verdicts (the 4-rank training itself is bench/planner_parallel.py --long): one
    32k-token sample exceeds a 1.5 GB budget on 1 rank, fits split over 4 ranks, and the advice says so."""
    model = str(write_config(tmp_path / "tiny32k", DEMO_32K))
    argv = ["--pretrain", model, "--dataset", "d.jsonl", "--max_len", "32768", "--micro_train_batch_size", "1",
            "--train_batch_size", "1", "--backend", "fsdp2", "--param_dtype", "fp32", "--dry_run",
            "--dry_run_gpu_memory_gb", "1.5"]
    one = dry_run(capsys, [*argv, "--dry_run_num_gpus", "1"])
    assert "verdict: DOES NOT FIT: largest per-device peak 2.01 GiB of 1.50 GiB" in one
    assert "4 GPUs with --ring_attn_size 4 (--dry_run_num_gpus 4 to plan it): peak 2.01 GiB -> 532.3 MiB (fits)" \
        in one
    four = dry_run(capsys, [*argv, "--dry_run_num_gpus", "4", "--ring_attn_size", "4"])
    assert "verdict: FITS: largest per-device peak 532.3 MiB of 1.50 GiB" in four


def test_rl_dry_run_plans_the_ring_and_advises_it(capsys, tmp_path):
    """train_ppo_ray: the actor's activations are split by --ring_attn_size; without it, the advice finds the ring
    sizes that divide every role's devices and the heads (4 devices, 32 heads: 2 and 4, not 8), and the planner
    stops a size that does not split the heads with one line. (`dry_run` on the parsed config: the CLI adds only
    its start-up notes, seconds of type-hint reading per run.)"""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.errors import UserError
    from rlhfkit.planner.dry_run import dry_run as plan

    model = str(write_config(tmp_path / "l7", {**LLAMA2_7B, "max_position_embeddings": 32768}))
    reward = str(Path(__file__).parents[1] / "distributed" / "reward_exact_match.py")
    argv = ["--pretrain", model, "--prompt_data", "p.jsonl", "--remote_rm_url", reward,
            "--advantage_estimator", "reinforce", "--init_kl_coef", "0", "--actor_num_gpus_per_node", "4",
            "--prompt_max_len", "31744", "--generate_max_len", "1024", "--train_batch_size", "4",
            "--micro_train_batch_size", "1", "--rollout_batch_size", "4", "--micro_rollout_batch_size", "1",
            "--vllm_num_engines", "1", "--vllm_gpu_memory_utilization", "0.5", "--bf16", "--gradient_checkpointing",
            "--dry_run", "--dry_run_gpu_memory_gb", "48"]

    def run(*extra: str) -> str:
        assert plan(parse_config(PPOConfig, [*argv, *extra], "x"), "ppo_ray", "x")
        return capsys.readouterr().out

    out = run()
    advised = [line.strip().split(":")[0] for line in out.splitlines() if line.strip().startswith("--ring_attn_size")]
    assert advised == ["--ring_attn_size 2", "--ring_attn_size 4"], out
    assert "/ ring 4" in run("--ring_attn_size", "4")
    with pytest.raises(UserError, match="--ring_attn_size 3 does not divide the model's 32 attention heads"):
        run("--ring_attn_size", "3", "--actor_num_gpus_per_node", "12", "--train_batch_size", "12",
            "--rollout_batch_size", "12")
