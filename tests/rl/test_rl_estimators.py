"""Every estimator through the one RL loop: 2 steps on the tiny demo model, finite metrics, weights that move.
Each run is `python -m rlhfkit.cli.train_ppo`'s main in this process (`tests.helpers.run_here`).

Also CISPO and SAPO, the reward-model path, the PPO loss variants (KL loss, dual clip, entropy, TIS, clip-higher),
exact resume, and a reward-function failure surfacing as one line with exit code 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_here

TEMPLATE = "User: {}\nAssistant: "
# A reward that differs between the samples of a prompt even for a random model: distinct characters / 10.
VARIED_REWARD = """
import torch


def reward_func(queries, prompts, labels):
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([len(set(r)) / 10 for r in responses])
    return {"rewards": rewards, "scores": (rewards > 0.3).float(), "extra_logs": {"distinct": rewards}}
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "varied_reward.py"
    path.write_text(VARIED_REWARD)
    return str(path)


def ppo_args(assets, save: Path, estimator: str, *extra: str) -> list[str]:
    return ["rlhfkit.cli.train_ppo", "--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train),
            "--input_key", "prompt", "--label_key", "answer", "--input_template", TEMPLATE,
            "--advantage_estimator", estimator, "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
            "--micro_rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--max_samples", "8", "--generate_max_len", "8", "--prompt_max_len", "32",
            "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--lr_warmup_ratio", "0",
            "--zero_stage", "2", "--save_path", str(save), "--disable_progress_bar", *extra]


def check(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def train_metrics(save: Path) -> list[dict]:
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("train/") for k in r)]


def assert_finite(rows: list[dict]) -> None:
    for row in rows:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, bad


def max_change(before: dict, after: dict, prefix: str = "") -> float:
    return max((after[prefix + k].float() - v.float()).abs().max().item() for k, v in before.items()
               if prefix + k in after)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo"])
def test_two_steps_of_every_estimator(demo_assets, reward_file, tmp_path, estimator, capsys):
    # gae also runs the critic's forwards packed (--packing_samples), and trains the critic with its own optimizer
    # (OpenRLHF's --critic.optim muon; the actor stays on AdamW); the other estimators stay padded.
    extra = ["--save_value_network", "--packing_samples", "--critic.optim", "muon", "--critic.max_norm", "0.5"] \
        if estimator == "gae" else []
    check(run_here(ppo_args(demo_assets, tmp_path, estimator, "--remote_rm_url", reward_file, *extra), capsys))
    rows = train_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    for row in rows:
        assert row["train/reward"] > 0 and "train/reward_extra/distinct" in row
        assert row["train/response_length"] <= 8
        for key in ("train/actor/policy_loss", "train/actor/clip_fraction", "train/actor/entropy", "train/kl",
                    "train/time/generate_s", "train/time/score_s", "train/time/train_s", "train/time/sync_s"):
            assert key in row, key
    initial = weights(demo_assets.model_dir)
    assert max_change(initial, weights(tmp_path)) > 1e-4
    if estimator == "gae":
        assert all("train/critic/value_loss" in r for r in rows)
        critic = weights(Path(str(tmp_path) + "_critic"))
        # The critic's backbone starts from the policy (no critic/reward model given) and is trained.
        assert max_change({k: v for k, v in initial.items() if k.startswith("model.")}, critic) > 1e-4
        assert "score.weight" in critic
    else:
        assert not any("train/critic/value_loss" in r for r in rows)


@pytest.mark.parametrize("loss_type, extra", [("cispo", ["--clip_eps_low", "1", "--clip_eps_high", "0.28"]),
                                              ("sapo", ["--tau_pos", "1.0", "--tau_neg", "1.05"])])
def test_two_grpo_steps_with_cispo_and_sapo(demo_assets, reward_file, tmp_path, loss_type, extra, capsys):
    check(run_here(ppo_args(demo_assets, tmp_path, "group_norm", "--remote_rm_url", reward_file,
                            "--policy_loss_type", loss_type, "--max_epochs", "2", *extra), capsys))
    rows = train_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    assert all("train/actor/clip_fraction" in r and "train/actor/policy_loss" in r for r in rows)
    assert max_change(weights(demo_assets.model_dir), weights(tmp_path)) > 1e-4


def test_reward_model_path_with_normalisation(demo_assets, tmp_path, capsys):
    # The demo backbone with a seeded value head, saved as train_rm saves a reward model; read at the last token.
    from transformers import AutoTokenizer

    from rlhfkit.models.value_model import load_value_model

    torch.manual_seed(0)
    rm = tmp_path.parent / f"{tmp_path.name}_rm"
    load_value_model(str(demo_assets.model_dir), require_head=False).save_pretrained(rm)
    AutoTokenizer.from_pretrained(demo_assets.model_dir).save_pretrained(rm)
    check(run_here(ppo_args(demo_assets, tmp_path, "reinforce", "--reward_pretrain", str(rm),
                            "--normalize_reward", "--init_kl_coef", "0.05", "--kl_estimator", "k2",
                            "--packing_samples"), capsys))  # reward model, reference and actor forwards packed
    rows = train_metrics(tmp_path)
    assert len(rows) == 2
    assert_finite(rows)
    assert rows[0]["train/reward_std"] > 0
    assert max_change(weights(demo_assets.model_dir), weights(tmp_path)) > 1e-4


def test_loss_variants_and_eval(demo_assets, reward_file, tmp_path, capsys):
    check(run_here(ppo_args(demo_assets, tmp_path, "group_norm", "--remote_rm_url", reward_file, "--use_kl_loss",
                            "--kl_estimator", "k3", "--init_kl_coef", "0.1", "--dual_clip", "3",
                            "--entropy_loss_coef", "0.01", "--enable_vllm_is_correction", "--clip_eps_high",
                            "0.28", "--max_epochs", "2", "--top_p", "0.9", "--eval_dataset",
                            str(demo_assets.rl_eval), "--max_samples", "8", "--eval_temperature", "1.0",
                            "--eval_n_samples_per_prompt", "2", "--eval_steps", "1", "--temperature", "0.8",
                            "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", "48"), capsys))
    rows = train_metrics(tmp_path)
    assert_finite(rows)
    for key in ("train/actor/kl_loss", "train/actor/dual_clip_fraction", "train/actor/tis_weight_mean"):
        assert key in rows[-1], key
    # Temperature-scaled log-probs: the engine's and the actor's (packed, token-budget micro-batches) agree (they
    # differ only by float rounding).
    assert all(r["train/rollout_logprob_diff"] < 1e-4 for r in rows)
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval/pass@1" in x]
    assert [e["step"] for e in evals] == [1, 2]
    assert all(0 <= e["eval/pass@1"] <= 1 and "eval/pass@2" in e for e in evals)


def test_resume_continues_exactly(demo_assets, reward_file, tmp_path, capsys):
    common = ["--remote_rm_url", reward_file, "--max_samples", "12", "--init_kl_coef", "0.01", "--kl_target", "0.1"]
    # one 3-step run that checkpoints at step 2 and trains on; the rerun resumes from that checkpoint (as after a
    # crash during step 3) and must train the same step 3
    full, ckpt = tmp_path / "full", tmp_path / "ckpt"
    check(run_here(ppo_args(demo_assets, full, "gae", *common, "--save_steps", "2", "--ckpt_path", str(ckpt),
                            "--save_hf_ckpt"), capsys))
    assert (ckpt / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in (ckpt / "global_step2").iterdir() if p.is_dir()) == ["actor", "actor_hf", "critic"]
    assert (ckpt / "global_step2" / "actor_hf" / "model.safetensors").is_file()
    second = tmp_path / "second"
    check(run_here(ppo_args(demo_assets, second, "gae", *common, "--load_checkpoint", "--ckpt_path", str(ckpt)),
                   capsys))
    resumed = train_metrics(second)
    assert [r["step"] for r in resumed] == [3]
    reference = train_metrics(full)[2]
    for key in ("train/reward", "train/kl", "train/kl_coef", "train/actor/policy_loss", "train/critic/value_loss"):
        assert resumed[0][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert max_change(weights(full), weights(second)) < 1e-5


def test_failing_reward_function_is_one_line_exit_2(demo_assets, tmp_path, capsys):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * (len(queries) + 1)\n")
    proc = run_here(ppo_args(demo_assets, tmp_path / "out", "reinforce", "--remote_rm_url", str(bad)), capsys)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert str(bad) in last and "returned 2 rewards for 1 query" in last  # retried in halves down to one sample
    assert "Traceback" not in proc.stderr


def test_http_reward_servers_through_the_loop(demo_assets, tmp_path, capsys):
    from tests.rewards.test_sources import _Server

    servers = [_Server(0.0), _Server(0.5)]
    try:
        urls = ",".join(s.url for s in servers)
        check(run_here(ppo_args(demo_assets, tmp_path, "rloo", "--remote_rm_url", urls), capsys))
    finally:
        for s in servers:
            s.close()
    assert all(len(s.received) == 2 for s in servers)  # two steps, each batch split over both servers
    assert all(len(r["query"]) == 4 for s in servers for r in s.received)
    rows = train_metrics(tmp_path)
    assert len(rows) == 2 and rows[0]["train/reward"] > 0
    assert_finite(rows)
