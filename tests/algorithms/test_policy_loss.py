"""PPO policy loss (clip, clip-higher, dual clip, TIS) and value loss against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.policy_loss import is_correction_weights, policy_loss, tis_weights, value_loss

F64 = torch.float64
NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def tokens():
    """Five action tokens over two rows (NaN log-probs at padding), ratios and advantages:

    t0: ratio 1.5, A = +1 -> min(1.5, 1.2) = 1.2       loss -1.2  (clipped)
    t1: ratio 0.5, A = +2 -> min(1.0, 0.8*2 = 1.6)     loss -1.0
    t2: ratio 0.5, A = -1 -> min(-0.5, -0.8) = -0.8    loss  0.8  (clipped)
    t3: ratio 1.0, A = +3 ->                           loss -3.0
    t4: ratio 4.0, A = -1 -> min(-4, -1.2) = -4        loss  4.0  (dual clip 3 -> 3.0)
    """
    old = torch.tensor([[-1.0, -1.0, -1.0, NAN], [-2.0, -2.0, NAN, NAN]], dtype=F64)
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.0], [1.0, 4.0, 1.0, 1.0]], dtype=F64)
    logp = (old + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, -1.0, NAN], [3.0, -1.0, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return logp, old, adv, mask


def test_symmetric_clip_values_gradient_and_info():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=0.2)
    close(loss, -0.08)  # (-1.2 - 1.0 + 0.8 - 3.0 + 4.0) / 5
    close(info["clip_fraction"], 0.4)  # t0, t2
    # approx KL = mean((ratio - 1) - log ratio) = (0.5 - ln 1.5 + 2 * (ln 2 - 0.5) + 0 + 3 - ln 4) / 5
    close(info["approx_kl"], 0.4189069783783671)
    close(info["ratio_mean"], 1.5)  # (1.5 + 0.5 + 0.5 + 1 + 4) / 5
    loss.backward()
    # d/dlogp of -ratio*A/5 where unclipped: t1 -2*0.5/5 = -0.2; t3 -3/5 = -0.6; t4 +4/5 = 0.8; clipped and padding 0
    close(logp.grad, [[0.0, -0.2, 0.0, 0.0], [-0.6, 0.8, 0.0, 0.0]])
    assert all(not v.requires_grad for v in info.values())


def test_clip_higher():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, -0.096)  # t0 becomes -1.28: (-1.28 - 1.0 + 0.8 - 3.0 + 4.0) / 5
    close(info["clip_fraction"], 0.4)


def test_dual_clip_bounds_negative_advantages():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, -0.28)  # t4: min(4, 3 * |-1|) = 3 -> (-1.2 - 1.0 + 0.8 - 3.0 + 3.0) / 5
    close(info["dual_clip_fraction"], 0.2)
    loss.backward()
    close(logp.grad, [[0.0, -0.2, 0.0, 0.0], [-0.6, 0.0, 0.0, 0.0]])  # the dual-clipped token has no gradient
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_aggregation_modes():
    logp, old, adv, mask = tokens()
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_mean")
    close(loss, ((-1.2 - 1.0 + 0.8) / 3 + (-3.0 + 4.0) / 2) / 2)  # (-0.4666667 + 0.5) / 2 = 0.0166667
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_sum_norm", norm_len=10)
    close(loss, ((-1.2 - 1.0 + 0.8) / 10 + (-3.0 + 4.0) / 10) / 2)  # -0.02
    loss, _ = policy_loss(logp, old, adv, mask, num_tokens=20)
    close(loss, -0.02)  # -0.4 / 20


def test_truncated_importance_sampling():
    logp, old, adv, mask = tokens()
    weights = torch.tensor([[0.5, 3.0, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0]], dtype=F64)
    rollout = old - weights.log()  # exp(old - rollout) = weights; capped at 2 -> [0.5, 2, 1 | 1.5, 1]
    loss, info = policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0)
    close(loss, -0.46)  # (-1.2*0.5 - 1.0*2 + 0.8*1 - 3.0*1.5 + 4.0*1) / 5 = -2.3 / 5
    close(info["tis_weight_mean"], 1.2)  # (0.5 + 2 + 1 + 1.5 + 1) / 5
    with pytest.raises(ValueError, match="both"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout)


def test_tis_weights():
    old = torch.tensor([math.log(0.5), math.log(3.0), 100.0])
    out = tis_weights(old, torch.zeros(3), cap=2.0)
    close(out, [0.5, 2.0, 2.0], tol=1e-6)  # min(exp(old - rollout), 2); exp(100) overflows to inf -> 2


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[1.5, 2.0, 0.0, NAN]], dtype=F64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.5, NAN]], dtype=F64)
    returns = torch.tensor([[1.6, 1.0, 1.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # unclipped errors: 0.01, 1, 1 -> 0.5 * 2.01 / 3
    loss, _ = value_loss(values, old, returns, mask)
    close(loss, 0.335)
    # clip 0.2: V_clip = 1.2, 1.2, 0.3 -> errors 0.16, 0.04, 0.49; max with unclipped: 0.16, 1, 1 -> 0.5 * 2.16 / 3
    loss, info = value_loss(values, old, returns, mask, value_clip=0.2)
    close(loss, 0.36)
    close(info["value_clip_fraction"], 1 / 3)
    loss.backward()
    # t0 takes the clipped branch (no gradient); t1: (2 - 1)/3; t2: (0 - 1)/3
    close(values.grad, [[0.0, 1 / 3, -1 / 3, 0.0]])


# -- GSPO and the importance-sampling corrections, against a float64 implementation written here ----------------
def reference_weights(old, rollout, mask, kind, low, high):
    """Per-token weights by plain Python loops over float64 numbers."""
    out = torch.zeros_like(old)
    for b in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[b, t]]
        ratios = {t: math.exp(float(old[b, t]) - float(rollout[b, t])) for t in tokens}
        geo = math.exp(sum(math.log(r) for r in ratios.values()) / len(tokens))
        for t, r in ratios.items():
            if kind == "tis":
                out[b, t] = min(max(r, low), high)
            elif kind == "icepop":
                out[b, t] = r if low <= r <= high else 0.0
            else:
                out[b, t] = r if low <= geo <= high else 0.0
    return out


def reference_gspo(logp, old, adv, mask, low, high):
    """Mean over sequences of -min(s A, clip(s) A), s = exp(mean over the sequence's tokens of logp - old)."""
    losses = []
    for b in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[b, t]]
        s = math.exp(sum(float(logp[b, t]) - float(old[b, t]) for t in tokens) / len(tokens))
        a = float(adv[b, tokens[0]])
        losses.append(-min(s * a, min(max(s, 1 - low), 1 + high) * a))
    return sum(losses) / len(losses)


def random_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    old = -torch.rand(4, 5, generator=gen, dtype=F64) * 2
    logp = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=F64)
    rollout = old + 0.6 * torch.randn(4, 5, generator=gen, dtype=F64)
    adv = torch.tensor([1.5, -0.7, 0.4, -2.0], dtype=F64)[:, None].expand(4, 5).clone()
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_is_corrections_match_float64_reference(kind):
    logp, old, rollout, adv, mask = random_batch()
    low, high = 0.8, 1.25
    expected = reference_weights(old, rollout, mask, kind, low, high)
    close(is_correction_weights(old, rollout, mask, kind, low, high), expected, tol=1e-6)
    assert (expected[mask.bool()] == 0).any() or kind == "tis"  # the band masks something in this batch
    # the weights multiply the PPO per-token loss (token mean here)
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * expected
    loss, info = policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=high, is_correction=kind,
                             is_low=low)
    close(loss, per_token[mask.bool()].mean(), tol=1e-6)
    close(info["is_masked_fraction"], (expected[mask.bool()] == 0).double().mean(), tol=1e-6)


def test_seq_mask_tis_masks_whole_sequences():
    old = torch.zeros(2, 3, dtype=F64)
    # row 0: ratios 2, 0.5, 1 -> geometric mean 1 (kept although 2 > high); row 1: ratios 1.5 each -> masked
    rollout = -torch.tensor([[math.log(2), math.log(0.5), 0.0], [math.log(1.5)] * 3], dtype=F64)
    mask = torch.ones(2, 3)
    close(is_correction_weights(old, rollout, mask, "seq-mask-tis", 0.5, 1.2), [[2.0, 0.5, 1.0], [0, 0, 0]])
    close(is_correction_weights(old, rollout, mask, "icepop", 0.5, 1.2), [[0.0, 0.5, 1.0], [0, 0, 0]])


def test_gspo_matches_float64_reference_with_sequence_mean():
    logp, old, _, adv, mask = random_batch(1)
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.15, loss_type="gspo",
                             agg="seq_mean_token_mean")
    close(loss, reference_gspo(logp, old, adv, mask, 0.1, 0.15), tol=1e-6)
    # one ratio per sequence: every token of a row carries the same ratio
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    close(info["ratio_mean"], (seq_ratio[:, None].expand(4, 5))[mask.bool()].mean(), tol=1e-6)


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    """Unclipped, d(-s A)/d logp_t = -A s / |y| on every token of the sequence (GSPO's eq. for the gradient)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.01, -1.98, -0.5]], dtype=F64)
    adv = torch.full((1, 3), 2.0, dtype=F64)
    mask = torch.ones(1, 3)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="gspo", agg="seq_mean_token_mean")
    loss.backward()
    s = math.exp(((logp.detach() - old).sum() / 3).item())
    close(logp.grad, torch.full((1, 3), -2.0 * s / 3, dtype=F64), tol=1e-9)
