"""RL sample packing (`--packing_samples`): the actor, critic, reference and reward forwards on one packed row give
the same per-token log-probs, values, sequence rewards and loss gradients as the padded batch (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algorithms.policy_loss import policy_loss, value_loss
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.role_forward import action_log_probs, action_values, sample_rewards
from rlhfkit.rollout.engine import SampledSequence

TOL = {"atol": 1e-5, "rtol": 0.0}


@pytest.fixture(scope="module")
def models(demo_assets):
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.value_model import load_value_model

    torch.manual_seed(0)  # the value head of a plain LM checkpoint starts random
    policy = load_causal_lm(str(demo_assets.model_dir), dtype=torch.float32).eval()
    critic = load_value_model(str(demo_assets.model_dir), dtype=torch.float32, require_head=False).eval()
    return policy, critic


def skewed_experience(vocab: int):
    """One micro-batch whose lengths differ a lot: most of a padded batch would be padding."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 1), (40, 25), (2, 4), (12, 1), (5, 30), (30, 2)]  # (prompt, response) lengths
    samples = []
    for prompt_len, response_len in shapes:
        ids = torch.randint(3, vocab, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(SampledSequence(ids[:prompt_len], ids[prompt_len:], [0.0] * response_len, "stop"))
    exp = experience_from_samples(samples, pad_id=0)
    real = int(exp.attention_mask.sum())
    assert real < 0.6 * exp.attention_mask.numel()  # the padded batch is mostly padding
    return exp


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_packed_forwards_equal_padded(models):
    policy, critic = models
    exp = skewed_experience(policy.config.vocab_size)
    mask = exp.action_mask
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            padded = action_log_probs(policy, exp, temperature)
            packed = action_log_probs(policy, exp, temperature, packed=True)
            torch.testing.assert_close(packed[mask], padded[mask], **TOL)
        torch.testing.assert_close(action_values(critic, exp, packed=True)[mask], action_values(critic, exp)[mask],
                                   **TOL)
        rewards = sample_rewards(critic, exp, packed=True)
        torch.testing.assert_close(rewards, sample_rewards(critic, exp), **TOL)
        # The reward is read at each sample's last real token: check against one forward per sample.
        for i in range(len(exp)):
            n = int(exp.attention_mask[i].sum())
            one = exp.select([i])
            one.sequences, one.attention_mask = one.sequences[:, :n], one.attention_mask[:, :n]
            torch.testing.assert_close(sample_rewards(critic, one)[0], rewards[i], **TOL)


def test_packed_loss_gradients_equal_padded(models):
    policy, critic = models
    exp = skewed_experience(policy.config.vocab_size)
    mask = exp.action_mask
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(mask.shape, generator=gen)
    with torch.no_grad():
        old = action_log_probs(policy, exp, 1.0) + 0.1 * torch.randn(mask.shape, generator=gen)
        old_values = action_values(critic, exp) + 0.1 * torch.randn(mask.shape, generator=gen)
    returns = torch.randn(mask.shape, generator=gen)
    actor_grads, critic_grads = [], []
    for packed in (False, True):
        loss, _ = policy_loss(action_log_probs(policy, exp, 1.0, packed), old, advantages, mask, clip_eps_low=0.2,
                              clip_eps_high=0.2, agg="token_mean")
        loss.backward()
        actor_grads.append(grads(policy))
        loss, _ = value_loss(action_values(critic, exp, packed), old_values, returns, mask, value_clip=0.5)
        loss.backward()
        critic_grads.append(grads(critic))
    for padded, packed in (actor_grads, critic_grads):
        assert padded.keys() == packed.keys() and len(padded) > 10
        assert max(float(g.abs().max()) for g in padded.values()) > 1e-3  # the losses do move the weights
        for name in padded:
            torch.testing.assert_close(packed[name], padded[name], **TOL, msg=name)
