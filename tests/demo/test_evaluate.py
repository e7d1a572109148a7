"""Greedy exact-match evaluation: a random-init model scores about 0; the harness counts right answers right."""

from __future__ import annotations

import torch

from rlhfkit.demo.evaluate import evaluate_exact_match, exact_match
from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE


def test_random_init_model_scores_about_zero(demo_assets, demo_model, demo_tokenizer):
    records = demo_assets.read("rl_eval")
    demo_model.train()
    try:
        assert exact_match(demo_model, demo_tokenizer, records) < 0.05
        assert demo_model.training  # the caller's mode is restored
    finally:
        demo_model.eval()


class _AnswerBook(torch.nn.Module):
    """A stand-in model whose `generate` appends the right answer (then eos, then junk) for addition prompts,
    and a wrong one otherwise. Checks left padding, eos stopping and the per-task bookkeeping."""

    def __init__(self, tokenizer, records):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tok = tokenizer
        self.book = {r["prompt"]: (r["answer"] if r["task"] == "addition" else "nope") for r in records}
        self.batches: list[torch.Tensor] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.batches.append(attention_mask.clone())
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            real = [i for i, m in zip(ids, mask) if m]
            assert mask == sorted(mask), "padding must be on the left"
            text = self.tok.decode(real, skip_special_tokens=True)
            question = text[len("User: "):-len("\nAssistant: ")]
            new = self.tok(self.book[question])["input_ids"] + [self.tok.eos_token_id] + self.tok("9")["input_ids"]
            rows.append(ids + (new + [self.tok.pad_token_id] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)


def test_harness_scores_a_known_answer_book(demo_assets, demo_tokenizer):
    records = demo_assets.read("rl_eval")[:50]
    model = _AnswerBook(demo_tokenizer, records)
    result = evaluate_exact_match(model, demo_tokenizer, records, batch_size=16)
    n_add = sum(r["task"] == "addition" for r in records)
    assert result.n == 50 and abs(result.accuracy - n_add / 50) < 1e-12
    assert result.per_task["addition"] == 1.0
    assert all(result.per_task[t] == 0.0 for t in result.per_task if t != "addition")
    assert [r for r, rec in zip(result.responses, records) if rec["task"] == "addition"] == \
        [rec["answer"] for rec in records if rec["task"] == "addition"]  # cut at eos, in record order
    assert len(model.batches) == 4 and any((b == 0).any() for b in model.batches)  # batched, some padding
    first = model.batches[0]
    assert first.shape[0] == 16


def test_sft_schema_records_and_bos(demo_assets, demo_tokenizer):
    records = demo_assets.read("sft_eval")[:8]
    as_rl = [{"prompt": r["question"], "answer": r["response"], "task": r["task"]} for r in records]
    seen = []

    class Echo(_AnswerBook):
        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            seen.extend(row[mask.index(1)] for row, mask in zip(input_ids.tolist(), attention_mask.tolist()))
            return super().generate(input_ids, attention_mask, max_new_tokens, **kwargs)

    assert exact_match(Echo(demo_tokenizer, as_rl), demo_tokenizer, records) == \
        sum(r["task"] == "addition" for r in records) / 8
    assert set(seen) == {demo_tokenizer.bos_token_id}  # prompts start with bos by default
    prompt_ids = demo_tokenizer(DEMO_INPUT_TEMPLATE.format(records[0]["question"]))["input_ids"]
    assert prompt_ids[0] != demo_tokenizer.bos_token_id
