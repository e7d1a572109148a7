"""Experience layout (positions, padding, split, concat) and the replay buffer's batching rule."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rl.experience import Experience, experience_from_samples
from rlhfkit.rl.replay_buffer import ReplayBuffer
from rlhfkit.rollout.engine import SampledSequence

PAD = 0


def samples() -> list[SampledSequence]:
    return [
        SampledSequence([5, 6, 7], [10, 11, 2], [-0.1, -0.2, -0.3], "stop"),
        SampledSequence([5], [12], [-0.4], "length"),
        SampledSequence([5, 6], [13, 14, 15, 16], [-0.5, -0.6, -0.7, -0.8], "length"),
    ]


def test_experience_from_samples_layout():
    exp = experience_from_samples(samples(), PAD)
    assert exp.sequences.tolist() == [[5, 6, 7, 10, 11, 2], [5, 12, 0, 0, 0, 0], [5, 6, 13, 14, 15, 16]]
    assert exp.attention_mask.sum(1).tolist() == [6, 2, 6]
    assert exp.prompt_lengths.tolist() == [3, 1, 2]
    assert exp.action_mask.long().tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    torch.testing.assert_close(exp.rollout_log_probs[2], torch.tensor([-0.5, -0.6, -0.7, -0.8]))
    assert exp.info["response_length"].tolist() == [3, 1, 4]
    assert exp.info["truncated"].tolist() == [0, 1, 1]
    # The logits at position prompt_length + j - 1 predict response token j.
    assert exp.action_positions()[0].tolist() == [2, 3, 4, 4]
    tokens = exp.action_tokens()
    assert tokens[0, :3].tolist() == [10, 11, 2] and tokens[2].tolist() == [13, 14, 15, 16] and tokens[1, 0] == 12


def test_split_trims_and_concat_pads_back():
    exp = experience_from_samples(samples(), PAD)
    exp.advantages = torch.arange(12, dtype=torch.float32).reshape(3, 4) * exp.action_mask
    parts = exp.split(1)
    assert [p.sequences.shape[1] for p in parts] == [6, 2, 6]
    assert [p.num_actions for p in parts] == [3, 1, 4]
    joined = Experience.concat(parts)
    assert torch.equal(joined.sequences, exp.sequences)
    assert torch.equal(joined.action_mask, exp.action_mask)
    assert torch.equal(joined.advantages, exp.advantages)
    assert torch.equal(joined.info["truncated"], exp.info["truncated"])


def test_dict_round_trip_and_concat_rejects_missing_fields():
    exp = experience_from_samples(samples(), PAD)
    back = Experience.from_dict(exp.to_dict())
    assert torch.equal(back.sequences, exp.sequences) and back.values is None
    other = experience_from_samples(samples(), PAD)
    other.values = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="values"):
        Experience.concat([exp, other])
    with pytest.raises(ValueError, match="unknown"):
        Experience.from_dict({**exp.to_dict(), "bogus": 1})


def big_experience(n: int = 16) -> Experience:
    lengths = [(i % 3) + 1 for i in range(n)]
    return experience_from_samples([SampledSequence([1, 2], [3] * k, [-1.0] * k, "stop") for k in lengths], PAD)


def test_replay_buffer_steps_and_token_counts():
    exp = big_experience(16)
    buf = ReplayBuffer(exp, train_batch_size=8, micro_batch_size=2, seed=0)
    steps = list(buf.epoch(0))
    assert len(steps) == 2 and all(len(s.micro_batches) == 4 for s in steps)
    assert sum(s.num_tokens for s in steps) == exp.num_action_tokens()
    for s in steps:
        assert s.num_tokens == sum(m.num_action_tokens() for m in s.micro_batches)
        assert s.num_seqs == 8
    # Shuffled per epoch, reproducibly.
    assert buf.order(0) != buf.order(1) and buf.order(0) == ReplayBuffer(exp, 8, 2, seed=0).order(0)


def test_replay_buffer_ranks_share_the_one_rank_micro_batches():
    exp = big_experience(16)
    one = [m.sequences.tolist() for s in ReplayBuffer(exp, 8, 2, seed=3).epoch(0) for m in s.micro_batches]
    ranks = [list(ReplayBuffer(exp, 8, 2, rank=r, world_size=2, seed=3).epoch(0)) for r in range(2)]
    merged = []
    for step in range(2):
        for k in range(2):
            for r in range(2):
                merged.append(ranks[r][step].micro_batches[k].sequences.tolist())
    assert merged == one
    assert ranks[0][0].num_tokens == ranks[1][0].num_tokens  # step totals are global


def test_replay_buffer_rejects_partial_steps():
    with pytest.raises(ValueError, match="multiple"):
        ReplayBuffer(big_experience(12), 8, 2)


def test_replay_buffer_token_budget_keeps_each_step_and_evens_the_ranks():
    # Sample i has the unique first token 100 + i; lengths 3..9 tokens.
    exp = experience_from_samples([SampledSequence([100 + i, 1], [3] * (1 + i % 7), [-1.0] * (1 + i % 7), "stop")
                                   for i in range(16)], PAD)

    def ids(micro):
        return [int(x) for x in micro.sequences[:, 0]]

    fixed = list(ReplayBuffer(exp, 8, 2, seed=3).epoch(0))
    for packed, cost in ((True, lambda m: int(m.attention_mask.sum())), (False, lambda m: m.sequences.numel())):
        one = list(ReplayBuffer(exp, 8, 2, seed=3, max_tokens=12, packed=packed).epoch(0))
        for f, d in zip(fixed, one):
            assert sorted(i for m in d.micro_batches for i in ids(m)) == sorted(i for m in f.micro_batches
                                                                                for i in ids(m))
            assert (d.num_tokens, d.num_seqs) == (f.num_tokens, f.num_seqs)
            assert all(cost(m) <= 12 for m in d.micro_batches) and d.real == [True] * len(d.micro_batches)
        assert [len(s.micro_batches) for s in one] != [4, 4]  # the split did change
        ranks = [list(ReplayBuffer(exp, 8, 2, rank=r, world_size=2, seed=3, max_tokens=12, packed=packed).epoch(0))
                 for r in range(2)]
        for step in range(2):
            r0, r1 = ranks[0][step], ranks[1][step]
            assert len(r0.micro_batches) == len(r1.micro_batches)  # the same number of forwards on every rank
            real = [i for r in (r0, r1) for k, m in enumerate(r.micro_batches) if r.is_real(k) for i in ids(m)]
            assert sorted(real) == sorted(i for m in one[step].micro_batches for i in ids(m))


def test_trimming_keeps_the_actions_after_an_agent_episodes_feedback():
    # an episode: 2 action tokens, 3 feedback tokens (mask 0), 2 more action tokens; a plain sample of 3 tokens
    episode = SampledSequence([1, 2], [10, 11, 20, 21, 22, 12, 13], [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0, -4.0],
                              "stop", [1, 1, 0, 0, 0, 1, 1])
    plain = SampledSequence([1], [5, 6, 7], [-0.5, -0.5, -0.5], "length")
    exp = experience_from_samples([episode, plain], pad_id=0).trimmed()
    assert exp.action_mask.shape[1] == 7  # not 4 (the most actions of a row): the last turn stays in the loss
    assert exp.rollout_log_probs[0].tolist() == [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0, -4.0]
    assert exp.action_mask[0].tolist() == [True, True, False, False, False, True, True]


def test_equal_reward_share_counts_groups_with_one_reward():
    """Groups of 3 consecutive samples, by hand: [1,1,1] equal, [1,0,1] not, [0,0,0] equal, [0.5,0.5,0.5000001]
    equal (within 1e-6): 3 of 4."""
    from rlhfkit.rl.trainer import equal_reward_share

    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5000001])
    assert equal_reward_share(rewards, 3) == 0.75
    assert equal_reward_share(torch.tensor([0.2, 0.3]), 1) == 1.0  # one sample per prompt: trivially equal
