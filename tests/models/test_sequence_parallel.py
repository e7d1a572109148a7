"""Sequence parallelism (Ulysses, `rlhfkit.models.sequence_parallel`): one batch split over 2 and 4 gloo ranks gives
the one-rank SFT, DPO and reward-model losses and gradients to 1e-5 in fp32, padded and packed (issue 20,
acceptance 3).

Each spawned rank builds the same seeded tiny Llama (4 query heads, 2 key/value heads: at 4 ranks the key/value
heads are repeated before the all-to-all), computes the one-rank reference with the group unset (the trainers'
own forward: `forward_logits` + `sft_loss`, `sequence_logps` + `dpo_loss`, `sequence_rewards` +
`pairwise_rm_loss`), then the sequence-parallel loss, and
compares. The gradient rules checked are the ones the trainers rely on (docs/distributed.md, Long context):
- SFT: each rank's loss is its own tokens' NLL over the step's target count; the ranks' gradients sum to the
  one-rank gradient.
- DPO and RM: every rank computes the same loss from group-summed sequence log-probs (DPO) or token values (RM);
  the ranks' gradients sum to P x the one-rank gradient (the trainers divide P out through the data-parallel
  world).
"""

from __future__ import annotations

import torch

from tests.helpers import spawn_ranks

PROMPT_AND_RESPONSES = [([5, 6, 7, 8, 9], [10, 11, 12]), ([5, 6, 13], [14, 15, 16, 17, 18, 19]),
                        ([20, 21, 22, 23], [24]), ([25, 26], [27, 28, 29, 30, 31, 32, 33])]


def tiny_llama(reward_model: bool = False) -> torch.nn.Module:
    """A causal LM, or a reward model (backbone + scalar `score` head, as `load_value_model` builds it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa", num_labels=1, pad_token_id=0)
    return (LlamaForSequenceClassification if reward_model else LlamaForCausalLM)(config).float()


def samples(pairs: bool) -> list[dict]:
    """SFT samples (prompt + response, loss on the response), or for DPO chosen rows then rejected rows."""
    from rlhfkit.data.tokens import prompt_response_sample

    if not pairs:
        return [prompt_response_sample(p, r) for p, r in PROMPT_AND_RESPONSES]
    chosen = [prompt_response_sample(p, r) for p, r in PROMPT_AND_RESPONSES[:2]]
    rejected = [prompt_response_sample(p, list(reversed(r)) + [40]) for p, r in PROMPT_AND_RESPONSES[:2]]
    return chosen + rejected


def sft_loss_value(model, batch, step_tokens: int) -> torch.Tensor:
    from rlhfkit.algorithms.sft_loss import sft_loss
    from rlhfkit.models.policy import forward_logits
    from rlhfkit.models.sequence_parallel import sequence_parallel_logprobs, sequence_parallel_size

    if sequence_parallel_size() == 1:
        logits = forward_logits(model, batch)
        return sft_loss(logits, batch["input_ids"], batch["loss_mask"], sample_ids=batch.get("sample_ids"),
                        num_tokens=step_tokens)
    logps, _, _, _ = sequence_parallel_logprobs(model, batch)
    return -logps.sum() / step_tokens


def dpo_loss_value(model, batch) -> torch.Tensor:
    from rlhfkit.algorithms.preference_losses import dpo_loss
    from rlhfkit.trainers.preference import sequence_logps

    logps, _, _ = sequence_logps(model, batch)
    reference = torch.tensor([-20.0, -25.0, -22.0, -24.0])
    return dpo_loss(logps[:2], logps[2:], reference[:2], reference[2:], beta=0.1)[0]


def rm_loss_value(model, batch) -> torch.Tensor:
    from rlhfkit.algorithms.preference_losses import pairwise_rm_loss
    from rlhfkit.models.value_model import sequence_rewards

    rewards = sequence_rewards(model, batch)
    return pairwise_rm_loss(rewards[:2], rewards[2:], None)


def loss_and_grads(kind: str, packing: bool, checkpointing: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from rlhfkit.data.collate import collate_samples

    model = tiny_llama(reward_model=kind == "rm")
    if checkpointing:  # the backward recomputes each layer, all-to-alls included
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = collate_samples(samples(kind != "sft"), pad_id=0, packing=packing)
    if kind == "sft":
        loss = sft_loss_value(model, batch, int(batch["loss_mask"][:, 1:].sum()))
    elif kind == "rm":
        loss = rm_loss_value(model, batch)
    else:
        loss = dpo_loss_value(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _check_group(group, size: int, where: str) -> None:
    """Every case on `group` (`size` ranks) against the one-rank reference computed on this rank."""
    import torch.distributed as dist

    from rlhfkit.models.sequence_parallel import set_sequence_parallel_group

    cases = [(kind, packing, False) for kind in ("sft", "dpo", "rm") for packing in (False, True)]
    for kind, packing, checkpointing in [*cases, ("sft", True, True)]:
        set_sequence_parallel_group(None)
        ref_loss, ref_grads = loss_and_grads(kind, packing)
        set_sequence_parallel_group(group)
        loss, grads = loss_and_grads(kind, packing, checkpointing)
        if kind == "sft":  # each rank holds its tokens' share of the loss
            dist.all_reduce(loss, group=group)
        for g in grads:
            dist.all_reduce(g, group=group)
            g /= 1 if kind == "sft" else size
        case = f"{kind} packing={packing} checkpointing={checkpointing} {where}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=case)
        for g, ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5, msg=case)


def _rank_main(rank: int, world: int, port: int) -> None:
    """4 ranks: one group of 4, then two groups of 2 ([0, 1] and [2, 3], each checked on its own)."""
    import torch.distributed as dist

    from rlhfkit.models.sequence_parallel import set_sequence_parallel_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _check_group(dist.group.WORLD, world, f"group of {world}, rank {rank}")
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _check_group(pairs[rank // 2], 2, f"group of 2, rank {rank}")
    finally:
        set_sequence_parallel_group(None)
        dist.destroy_process_group()


def test_split_sample_gives_one_rank_loss_and_gradients():
    spawn_ranks(_rank_main, 4)


def test_block_causal_mask_is_the_packed_mask_as_booleans():
    from rlhfkit.models.policy import packed_attention_mask
    from rlhfkit.models.sequence_parallel import block_causal_mask

    sample_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    allowed = block_causal_mask(sample_ids)
    additive = packed_attention_mask(sample_ids, torch.float32)
    assert torch.equal(allowed, additive == 0)
