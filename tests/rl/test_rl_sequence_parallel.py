"""Sequence parallelism in the RL roles (--ring_attn_size, issue 20 acceptance 3, RL part): a rollout's rows split
over a group of 2 gloo ranks give the one-rank actor step (PPO-clip policy loss + k3 KL loss + entropy bonus, at a
sampling temperature), its gradients, the reference's log-probs, the critic's value loss and gradients and the
reward model's scores to 1e-5 in fp32, padded and packed.

Each spawned rank builds the same seeded tiny Llama (`tests/models/test_sequence_parallel.py`), computes the
one-rank reference with the group unset through the roles' own forwards (`actor_forward`, `action_log_probs`,
`action_values`, `sample_rewards` of `rlhfkit.rl.role_forward`), then the same on the group. Every rank of the
group computes the whole loss from whole [B, R] log-probs or values, so its gradients summed over the group are
P x the one-rank gradients (the roles divide P out through the data-parallel world, `_TrainedRole._step_scale`).
Plus the pure parts: how a Ray role group hands a "split" call's rows to sequence-parallel groups.
"""

from __future__ import annotations

import torch

from tests.helpers import spawn_ranks
from tests.models.test_sequence_parallel import tiny_llama

TEMPERATURE = 0.7


def experience():
    """Two prompts x two samples of different lengths (the one-rank forward shares each prompt's prefix), with
    old log-probs, reference log-probs, advantages, values and returns."""
    from rlhfkit.rl.experience import experience_from_samples
    from rlhfkit.rollout.engine import FINISH_LENGTH, SampledSequence

    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt_len in (5, 3):
        prompt = torch.randint(5, 60, (prompt_len,), generator=g).tolist()
        for length in (4, 7):
            response = torch.randint(5, 60, (length,), generator=g).tolist()
            samples.append(SampledSequence(prompt, response, [0.0] * length, FINISH_LENGTH))
    exp = experience_from_samples(samples, pad_id=0)
    shape = exp.action_mask.shape
    exp.action_log_probs = -2.0 + 0.3 * torch.randn(shape, generator=g)
    exp.base_action_log_probs = -2.0 + 0.3 * torch.randn(shape, generator=g)
    exp.advantages = torch.randn(shape, generator=g)
    exp.values = 0.1 * torch.randn(shape, generator=g)
    exp.returns = torch.randn(shape, generator=g)
    return exp


def actor_loss(model, exp, packed: bool) -> torch.Tensor:
    """The loss `ActorRole._micro_step` builds (policy loss, KL loss, entropy bonus), from `actor_forward`."""
    from rlhfkit.algorithms.kl import compute_approx_kl
    from rlhfkit.algorithms.masking import aggregate_loss
    from rlhfkit.algorithms.policy_loss import policy_loss
    from rlhfkit.rl.role_forward import actor_forward

    mask = exp.action_mask
    _, logp, entropy = actor_forward(model, exp, TEMPERATURE, packed, entropy="loss")
    loss, _ = policy_loss(logp, exp.action_log_probs, exp.advantages, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    kl = compute_approx_kl(logp, exp.base_action_log_probs, "k3", mask, clamp=10.0)
    return loss + 0.01 * aggregate_loss(kl, mask) - 0.01 * aggregate_loss(entropy, mask)


def critic_loss(model, exp, packed: bool) -> torch.Tensor:
    from rlhfkit.algorithms.policy_loss import value_loss
    from rlhfkit.rl.role_forward import action_values

    return value_loss(action_values(model, exp, packed), exp.values, exp.returns, exp.action_mask, value_clip=0.2)[0]


def role_results(packed: bool) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Every role's numbers on one experience: losses and gradients of actor and critic, reference log-probs
    (no gradient) and reward-model scores."""
    from rlhfkit.rl.role_forward import action_log_probs, sample_rewards

    exp = experience()
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for role, loss_of in (("actor", actor_loss), ("critic", critic_loss)):
        model = tiny_llama(reward_model=role == "critic")
        loss = loss_of(model, exp, packed)
        loss.backward()
        out[role] = loss.detach()
        out[f"{role}_grads"] = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        out["ref_logp"] = action_log_probs(tiny_llama(), exp, 1.0, packed) * exp.action_mask
        out["rewards"] = sample_rewards(tiny_llama(reward_model=True), exp, packed)
    return out


def _rank_main(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from rlhfkit.models.sequence_parallel import set_sequence_parallel_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for packed in (False, True):
            set_sequence_parallel_group(None)
            reference = role_results(packed)
            set_sequence_parallel_group(dist.group.WORLD)
            split = role_results(packed)
            for name, ref in reference.items():
                case = f"{name} packed={packed} rank {rank}"
                if isinstance(ref, list):  # gradients: the group's sum is P x the one-rank gradient
                    for g, r in zip(split[name], ref):
                        dist.all_reduce(g)
                        torch.testing.assert_close(g / world, r, rtol=1e-5, atol=1e-5, msg=case)
                else:
                    torch.testing.assert_close(split[name], ref, rtol=1e-5, atol=1e-5, msg=case)
    finally:
        set_sequence_parallel_group(None)
        dist.destroy_process_group()


def test_rl_roles_on_a_split_sample_give_the_one_rank_numbers():
    spawn_ranks(_rank_main, 2)


def test_split_calls_give_each_sequence_parallel_group_one_part():
    from rlhfkit.distributed.rank_split import join_from_ranks, results_of_groups, split_for_groups

    rows = torch.arange(6)
    parts = split_for_groups(rows, world_size=4, sp_size=2)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert torch.equal(join_from_ranks(results_of_groups(parts, 2)), rows)
    assert [p.tolist() for p in split_for_groups(rows, 2)] == [[0, 1, 2], [3, 4, 5]]  # no sequence parallelism
