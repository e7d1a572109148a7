"""The Transformers rollout engine: log-probs equal a teacher-forced forward, lengths, stops, seeds, weight updates."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algorithms.logprobs import token_logprobs
from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, RolloutEngine
from rlhfkit.rollout.hf_engine import HFRolloutEngine, sample_tokens

PROMPTS = ["What is 12+7?", "Reverse the letters of abc.", "How many letters are in qwzt?", "What is 1+1?"]


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).eval()
    return model, tok


@pytest.fixture(scope="module")
def engine(demo_assets, model_and_tokenizer):
    _, tok = model_and_tokenizer
    return HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tok)


def prompt_ids(tok, texts=PROMPTS) -> list[list[int]]:
    # Different lengths on purpose: the batch is left-padded inside the engine.
    return [[tok.bos_token_id] + tok(f"User: {t}\nAssistant: ", add_special_tokens=False).input_ids for t in texts]


def teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float() / temperature
    return token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1:]


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(engine, model_and_tokenizer, temperature):
    model, tok = model_and_tokenizer
    samples = engine.generate(prompt_ids(tok) * 2, max_new_tokens=12, temperature=temperature, seed=3)
    assert len(samples) == 8
    for s in samples:
        assert len(s.logprobs) == len(s.response_ids) > 0
        expected = teacher_forced(model, s.prompt_ids, s.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)


def test_max_new_tokens_and_length_finish(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    for max_new in (1, 5):
        samples = engine.generate(prompt_ids(tok), max_new_tokens=max_new, temperature=1.0, seed=0)
        for s in samples:
            assert 1 <= len(s.response_ids) <= max_new
            if s.finish_reason == FINISH_LENGTH:
                assert len(s.response_ids) == max_new
                assert not set(s.response_ids) & set(engine.eos_ids)


def test_stops_at_eos_and_includes_it(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    ids = prompt_ids(tok)
    greedy = engine.generate(ids, max_new_tokens=6, temperature=0)
    stop = greedy[0].response_ids[2]  # make the third greedy token of sample 0 a stop token
    out = engine.generate(ids, max_new_tokens=6, temperature=0, stop_token_ids=[stop])
    first = greedy[0].response_ids.index(stop)
    assert out[0].response_ids == greedy[0].response_ids[:first + 1]
    assert out[0].finish_reason == FINISH_STOP
    # The tokenizer's eos is a stop token without being asked for.
    engine_eos = HFRolloutEngine(engine.model, tok)
    engine_eos.eos_ids = [stop]
    assert engine_eos.generate(ids[:1], max_new_tokens=6, temperature=0)[0].response_ids[-1] == stop
    assert tok.eos_token_id in engine.eos_ids


def test_seeded_sampling_is_reproducible(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    ids = prompt_ids(tok) * 4
    a = engine.generate(ids, max_new_tokens=6, temperature=1.0, seed=11)
    b = engine.generate(ids, max_new_tokens=6, temperature=1.0, seed=11)
    c = engine.generate(ids, max_new_tokens=6, temperature=1.0, seed=12)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_chunked_batches_give_the_same_samples(demo_assets, model_and_tokenizer):
    model, tok = model_and_tokenizer
    small = HFRolloutEngine(model, tok, max_batch_size=3)
    big = HFRolloutEngine(model, tok, max_batch_size=64)
    ids = prompt_ids(tok)
    assert [s.response_ids for s in small.generate(ids, max_new_tokens=5, temperature=0)] == \
        [s.response_ids for s in big.generate(ids, max_new_tokens=5, temperature=0)]


def test_top_p_and_top_k_filtering():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 200)
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample_tokens(logits, 1.0, 0.5, -1, g)  # the top token alone holds > 0.5 of the mass
    assert tokens.eq(0).all()
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[:, 0])  # log-probs before truncation
    tokens, _ = sample_tokens(logits, 1.0, 1.0, 2, g)
    assert set(tokens.tolist()) == {0, 1}
    tokens, logp = sample_tokens(logits, 0, 1.0, -1, g)
    assert tokens.eq(0).all()


def test_update_weights_replaces_the_policy(model_and_tokenizer):
    import copy

    model, tok = model_and_tokenizer
    engine = HFRolloutEngine(copy.deepcopy(model), tok)
    other = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ids = prompt_ids(tok)
    before = engine.generate(ids, max_new_tokens=6, temperature=0)
    assert engine.update_weights(other.state_dict()) == len(other.state_dict())
    after = engine.generate(ids, max_new_tokens=6, temperature=0)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    for s in after:
        torch.testing.assert_close(torch.tensor(s.logprobs), teacher_forced(other, s.prompt_ids, s.response_ids, 1.0),
                                   atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="no parameter"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})


def test_repeated_prompts_are_prefilled_once_and_sampled_apart(engine, model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompt_ids(tok)
    greedy = [s.response_ids for s in engine.generate(ids, max_new_tokens=6, temperature=0)]
    repeated = engine.generate([p for p in ids for _ in range(3)], max_new_tokens=6, temperature=0)
    assert [s.response_ids for s in repeated] == [r for r in greedy for _ in range(3)]
    sampled = engine.generate([ids[0]] * 8, max_new_tokens=8, temperature=1.0, seed=5)
    assert len({tuple(s.response_ids) for s in sampled}) > 1  # each copy of the prompt samples on its own
    for s in sampled:
        torch.testing.assert_close(torch.tensor(s.logprobs), teacher_forced(model, s.prompt_ids, s.response_ids, 1.0),
                                   atol=1e-4, rtol=0)
