"""The names the math dispatches on, declared once: the flags' `choices=` and the algorithms' checks read these.

They live here rather than in `rlhfkit/algorithms` because config is the first layer (tests/test_import_graph.py):
algorithms may import config, config may not import algorithms (and importing any algorithms module would load
torch, which parsing flags does not need). Each algorithms module re-exports the tuples it dispatches on, next to
the function that dispatches, so a reader of the math sees the list it checks against.
"""

from __future__ import annotations

ADVANTAGE_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo")
GROUP_BASELINES = ("reinforce_baseline", "group_norm", "dr_grpo", "rloo")  # estimators that compare a prompt's samples
KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo", "sapo")
IS_CORRECTIONS = ("tis", "icepop", "seq-mask-tis")
DISTILL_LOSSES = ("reverse_kl", "topk_forward_kl")  # --distill_loss (rlhfkit.algorithms.distill_loss)
AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
SFT_REDUCTIONS = ("mean", "sum", "per_sample")
RM_LOSS_KINDS = ("sigmoid", "logexp")
DPO_LOSS_TYPES = ("sigmoid", "simpo", "orpo")  # train_dpo --loss_type; simpo and orpo need no reference
REFERENCE_FREE_DPO_LOSSES = ("simpo", "orpo")
