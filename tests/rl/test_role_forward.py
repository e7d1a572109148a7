"""The RL roles' forwards: samples that repeat a prompt (n samples per prompt) run it once and get the log-probs,
and the gradients, of the plain padded forward."""

from __future__ import annotations

import torch

from rlhfkit.models import shared_prefix
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.role_forward import action_log_probs
from rlhfkit.rollout.engine import FINISH_LENGTH, SampledSequence


def rollout() -> list[SampledSequence]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 4, 9)]
    samples = []
    for p in prompts:
        for length in (5, 2, 6):  # three samples per prompt, responses of different lengths
            response = torch.randint(5, 200, (length,), generator=g).tolist()
            samples.append(SampledSequence(p, response, [0.0] * length, FINISH_LENGTH))
    return samples


def test_shared_prompt_forward_equals_the_plain_one(demo_assets, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32)
    exp = experience_from_samples(rollout(), pad_id=0)
    mask = exp.action_mask

    def log_probs_and_grads():
        model.zero_grad()
        logp = action_log_probs(model, exp, temperature=0.7)
        (logp * mask).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    original = shared_prefix.shared_prefix_logits
    monkeypatch.setattr("rlhfkit.rl.role_forward.shared_prefix_logits",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    shared, shared_grads = log_probs_and_grads()
    assert calls, "three samples per prompt should run the shared-prefix forward"
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_FRACTION", 2.0)  # never pays: the plain forward
    plain, plain_grads = log_probs_and_grads()
    assert len(calls) == 1
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=0)
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
