"""Role helpers without DeepSpeed engines: action logits/log-probs against a plain forward, LoRA weight export."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.algorithms.logprobs import token_logprobs
from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.role_forward import action_log_probs, action_logits, hf_state_dict
from rlhfkit.rollout.engine import SampledSequence
from rlhfkit.rollout.hf_engine import HFRolloutEngine


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).eval(),
            AutoTokenizer.from_pretrained(demo_assets.model_dir))


def experience():
    return experience_from_samples([
        SampledSequence([1, 5, 6, 7], [10, 11, 2], [0.0] * 3, "stop"),
        SampledSequence([1, 5], [12, 13, 14, 15, 16], [0.0] * 5, "length"),
        SampledSequence([1, 5, 6, 7, 8, 9, 10], [12], [0.0], "length"),
    ], pad_id=0)


def test_action_log_probs_equal_per_sample_forwards(model_and_tokenizer):
    model, _ = model_and_tokenizer
    exp = experience()
    with torch.no_grad():
        got = action_log_probs(model, exp, temperature=0.7)
    for i in range(len(exp)):
        n_prompt, n_resp = int(exp.prompt_lengths[i]), int(exp.action_mask[i].sum())
        ids = exp.sequences[i:i + 1, :n_prompt + n_resp]
        with torch.no_grad():
            logits = model(ids).logits[:, :-1] / 0.7
        expected = token_logprobs(logits, ids[:, 1:])[0, n_prompt - 1:]
        torch.testing.assert_close(got[i, :n_resp], expected, atol=1e-5, rtol=0)
    assert action_logits(model, exp).shape == (3, 5, model.config.vocab_size)


def test_lora_weights_are_exported_merged_under_transformers_names(model_and_tokenizer):
    from rlhfkit.models.lora import apply_lora

    model, tok = model_and_tokenizer
    peft_model = apply_lora(copy.deepcopy(model), rank=4, alpha=8, dropout=0.0, target_modules=None)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # B starts at 0: make the adapter do something
    strategy = DeepSpeedStrategy(StrategyArgs(zero_stage=0, train_batch_size=1, micro_train_batch_size=1))
    state = hf_state_dict(strategy, peft_model)
    assert set(state) == set(model.state_dict())
    engine = HFRolloutEngine(copy.deepcopy(model), tok)
    engine.update_weights(state)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        expected = peft_model(ids).logits
        got = engine.model(ids).logits
        base = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - base).abs().max() > 1e-3
    # The adapter is unmerged again: the trainable model is unchanged by the export.
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, expected)


def test_reused_old_log_probs_train_like_an_extra_forward(demo_assets, restore_env):
    """One optimizer step per rollout: the actor trained without old log-probs (it takes its own training forward's,
    detached) ends with the weights and metrics of the actor given them by the extra no-grad forward."""
    from rlhfkit.algorithms.kl import compute_approx_kl
    from rlhfkit.algorithms.masking import masked_mean
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.rl_specs import actor_spec
    from rlhfkit.rl.roles import ActorRole

    cfg = parse_config(PPOConfig, [
        "--pretrain", str(demo_assets.model_dir), "--train_batch_size", "6", "--micro_train_batch_size", "3",
        "--micro_rollout_batch_size", "3", "--rollout_batch_size", "3", "--n_samples_per_prompt", "2",
        "--actor_learning_rate", "1e-2", "--lr_warmup_ratio", "0", "--zero_stage", "0", "--use_kl_loss",
        "--init_kl_coef", "0.1", "--temperature", "0.9"], "test")
    g = torch.Generator().manual_seed(0)
    exp = experience_from_samples([SampledSequence([1] + torch.randint(3, 60, (p,), generator=g).tolist(),
                                                   torch.randint(3, 60, (r,), generator=g).tolist(),
                                                   (-torch.rand(r, generator=g) * 3).tolist(), "length")
                                   for p, r in [(3, 5), (6, 2), (2, 7), (4, 4), (5, 1), (3, 6)]], pad_id=0)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    exp.base_action_log_probs = -torch.rand(exp.action_mask.shape, generator=g) * 3
    extra_forward, reusing = ActorRole(actor_spec(cfg), 1), ActorRole(actor_spec(cfg), 1)
    given = exp.to_dict()
    given["action_log_probs"] = extra_forward.log_probs(exp)
    expected = extra_forward.train(given, kl_coef=0.1, seed=3)
    got = reusing.train(exp.to_dict(), kl_coef=0.1, seed=3, entropy_metric=False)

    for key in ("policy_loss", "kl_loss", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert "entropy" in expected and "entropy" not in got  # not computed when the step is not logged
    mask = exp.action_mask
    loop_kl = masked_mean(compute_approx_kl(given["action_log_probs"], exp.base_action_log_probs, "k1", mask),
                          mask, dim=-1).mean()
    assert got["old_kl"] == pytest.approx(float(loop_kl), abs=1e-5)
    loop_diff = masked_mean((given["action_log_probs"] - exp.rollout_log_probs).abs(), mask)
    assert got["old_rollout_logprob_diff"] == pytest.approx(float(loop_diff), abs=1e-5)
    before = extra_forward.state_dict()
    for name, w in reusing.state_dict().items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=1e-6)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).state_dict()
    assert max(float((w - initial[name]).abs().max()) for name, w in before.items()) > 1e-3  # the step moved it
    with pytest.raises(ValueError, match="one optimizer step"):
        reusing.train({**exp.select(slice(0, 3)).to_dict()}, kl_coef=0.1)


def test_local_roles_implement_their_protocols_and_declare_their_dispatch():
    """Each local role has every method of its Protocol (role_protocols.py) with the same parameters, and the
    scoring forwards, only they, are declared split over a group's ranks (`@dispatch("split")`)."""
    import inspect

    from rlhfkit.rewards.sources import RewardFunction
    from rlhfkit.rl import role_protocols as p
    from rlhfkit.rl.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole

    pairs = [(p.Actor, ActorRole), (p.Critic, CriticRole), (p.Reference, ReferenceRole), (p.Reward, RewardModelRole),
             (p.Reward, RewardFunction)]
    for protocol, cls in pairs:
        members = [m for m in dir(protocol) if not m.startswith("_") and callable(getattr(protocol, m))]
        assert members, protocol
        for m in members:
            want = list(inspect.signature(getattr(protocol, m)).parameters)
            assert list(inspect.signature(getattr(cls, m)).parameters) == want, (cls.__name__, m)
    split = {(cls.__name__, m) for cls in (ActorRole, CriticRole, ReferenceRole, RewardModelRole) for m in dir(cls)
             if getattr(getattr(cls, m), "dispatch_mode", None) == "split"}
    assert split == {("ActorRole", "log_probs"), ("ReferenceRole", "log_probs"), ("CriticRole", "values"),
                     ("RewardModelRole", "score")}
