"""The math's errors are programmer errors: every check in rlhfkit/algorithms raises ValueError in the math's own
terms (a bug keeps its traceback), and a user can never reach one, because the config's validate() refuses the same
condition first, as a one-line flag message with exit code 2."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlhfkit.algorithms import (
    aggregate_loss,
    clip_rewards,
    compute_advantages,
    compute_approx_kl,
    dpo_loss,
    group_baseline,
    grouped,
    is_correction_weights,
    kto_loss,
    pairwise_rm_loss,
    policy_loss,
    sft_loss,
    value_loss,
)
from rlhfkit.algorithms.kl import AdaptiveKLController
from rlhfkit.cli.common import run_cli
from tests.helpers import error_lines

ALGORITHMS = Path(__file__).resolve().parents[2] / "rlhfkit" / "algorithms"
T = torch.zeros(2, 3)
MASK = torch.ones(2, 3)
PAIR = torch.zeros(2)

# the math call, the message it raises (ValueError), and, where a flag leads there, the CLI, its flags and the
# one-line message the config gives for them instead
CASES: dict[str, tuple[Callable[[], object], str, tuple[str, str, str] | None]] = {
    "dual clip": (lambda: policy_loss(T, T, T, MASK, dual_clip=1.0), "dual_clip must be > 1",
                  ("train_ppo", "--dual_clip 1.0", "--dual_clip must be > 1")),
    "negative clip": (lambda: policy_loss(T, T, T, MASK, clip_eps_low=-0.1), "clip epsilons must be >= 0",
                      ("train_ppo", "--eps_clip -0.1", "clip ranges must be >= 0")),
    "policy loss type": (lambda: policy_loss(T, T, T, MASK, loss_type="nope"), "unknown policy loss type",
                         ("train_ppo", "--policy_loss_type nope", "invalid choice: 'nope'")),
    "tis without cap": (lambda: policy_loss(T, T, T, MASK, rollout_logp=T), "needs both", None),
    "is correction": (lambda: is_correction_weights(T, T, MASK, "nope", 0.0, 2.0), "importance-sampling",
                      ("train_ppo", "--vllm_is_correction_type nope", "invalid choice: 'nope'")),
    "value clip": (lambda: value_loss(T, T, T, MASK, value_clip=0.0), "value_clip must be > 0",
                   ("train_ppo", "--value_clip 0", "--value_clip must be > 0")),
    "kl target": (lambda: AdaptiveKLController(0.1, -1.0, 10.0), "target > 0 and horizon > 0",
                  ("train_ppo", "--kl_target -1", "--kl_target and --kl_horizon must be > 0")),
    "kl estimator": (lambda: compute_approx_kl(T, T, "k4"), "unknown KL estimator",
                     ("train_ppo", "--kl_estimator k4", "invalid choice: 'k4'")),
    "group of one": (lambda: group_baseline(PAIR, 1, "group_norm"), "at least 2 samples",
                     ("train_ppo", "--advantage_estimator group_norm --n_samples_per_prompt 1",
                      "needs --n_samples_per_prompt > 1")),
    "group baseline": (lambda: group_baseline(PAIR, 2, "gae"), "unknown group baseline", None),
    "advantage estimator": (lambda: compute_advantages("nope", rewards=PAIR, action_mask=MASK),
                            "unknown advantage estimator",
                            ("train_ppo", "--advantage_estimator nope", "invalid choice: 'nope'")),
    "gae without values": (lambda: compute_advantages("gae", rewards=PAIR, action_mask=MASK), "critic's values",
                           None),
    "aggregation": (lambda: aggregate_loss(T, MASK, "nope"), "unknown loss aggregation",
                    ("train_ppo", "--policy_loss_agg nope", "invalid choice: 'nope'")),
    "num_seqs with token_mean": (lambda: aggregate_loss(T, MASK, "token_mean", num_seqs=2), "num_seqs", None),
    "num_tokens with seq mode": (lambda: aggregate_loss(T, MASK, "seq_mean_token_mean", num_tokens=2),
                                 "num_tokens", None),
    "whole groups": (lambda: grouped(torch.zeros(3), 2), "whole groups", None),
    "reward clip": (lambda: clip_rewards(PAIR, 0.0), "clip_range must be > 0",
                    ("train_ppo", "--reward_clip_range 0", "low must be below high")),
    "rm loss": (lambda: pairwise_rm_loss(PAIR, PAIR, kind="nope"), "unknown reward-model loss",
                ("train_rm", "--loss nope", "invalid choice: 'nope'")),
    "rm reduction": (lambda: pairwise_rm_loss(PAIR, PAIR, reduction="sum"), "unknown reduction", None),
    "dpo beta": (lambda: dpo_loss(PAIR, PAIR, PAIR, PAIR, beta=0.0), "DPO's beta must be > 0",
                 ("train_dpo", "--beta 0", "--beta must be > 0")),
    "label smoothing": (lambda: dpo_loss(PAIR, PAIR, PAIR, PAIR, 0.1, label_smoothing=0.5), "flip probability",
                        ("train_dpo", "--label_smoothing 0.5", "--label_smoothing must be in [0, 0.5)")),
    "ipo with smoothing": (lambda: dpo_loss(PAIR, PAIR, PAIR, PAIR, 0.1, label_smoothing=0.1, ipo=True),
                           "IPO has no label smoothing",
                           ("train_dpo", "--ipo --label_smoothing 0.1", "does not apply to --ipo")),
    "kto beta": (lambda: kto_loss(PAIR, PAIR, torch.tensor([True, False]), 0.0, beta=0.0), "KTO's beta must be > 0",
                 ("train_kto", "--beta 0", "--beta must be > 0")),
    "sft reduction": (lambda: sft_loss(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long),
                                       torch.ones(1, 3), reduction="nope"), "unknown SFT loss reduction", None),
}


def test_no_algorithms_module_raises_or_imports_user_error():
    for path in sorted(ALGORITHMS.glob("*.py")):
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        assert "UserError" not in names and "UserError" not in path.read_text(), path


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_math_raises_value_error_in_its_own_terms(case):
    call, message, _ = CASES[case]
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        call()
    assert "--" not in str(e.value), "the math speaks of its arguments, not of flags"


@pytest.mark.parametrize("case", sorted(c for c, (_, _, cli) in CASES.items() if cli))
def test_the_cli_refuses_the_same_condition_with_a_one_line_flag_message(case, capsys):
    command, flags, message = CASES[case][2]
    main = importlib.import_module(f"rlhfkit.cli.{command}").main
    try:
        code = run_cli(main, flags.split(), prog=command)
    except SystemExit as e:  # argparse's choice errors exit from the parser, also one line
        code = e.code
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert "Traceback" not in err[0]
