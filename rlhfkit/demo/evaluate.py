"""Greedy exact-match evaluation of a causal LM on demo records (fast enough for CPU: batched, left-padded).

Records may use either demo schema: `{"prompt", "answer"}` (RL files) or `{"question", "response"}` (SFT
files); a `task` key, when present, gives per-task accuracy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE, is_correct


@dataclass
class ExactMatchResult:
    """`accuracy` over all records, `per_task` accuracy, and the decoded responses in record order."""

    accuracy: float
    n: int
    per_task: dict[str, float] = field(default_factory=dict)
    responses: list[str] = field(default_factory=list)


def _prompt_and_answer(record: Mapping) -> tuple[str, str]:
    prompt = record["prompt"] if "prompt" in record else record["question"]
    answer = record["answer"] if "answer" in record else record["response"]
    return str(prompt), str(answer)


def _prompt_ids(tokenizer, prompt: str, input_template: str | None, add_bos: bool,
                use_chat_template: bool) -> list[int]:
    if use_chat_template:
        # The chat template writes `<s>` itself.
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    text = input_template.format(prompt) if input_template else prompt
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []) + ids


@torch.no_grad()
def _greedy_batch(model, prompts: list[list[int]], pad_id: int, eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (eos and what follows removed) of left-padded prompts."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    device = next(model.parameters()).device
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                         pad_token_id=pad_id)
    continuations = []
    for row in out[:, width:].tolist():
        continuations.append(row[:row.index(eos_id)] if eos_id in row else row)
    return continuations


def evaluate_exact_match(model, tokenizer, records: Sequence[Mapping],
                         input_template: str | None = DEMO_INPUT_TEMPLATE, max_new_tokens: int = 8,
                         batch_size: int = 64, add_bos: bool = True,
                         use_chat_template: bool = False) -> ExactMatchResult:
    """Greedy-decode every record's prompt and score it with `tasks.is_correct`.

    The prompt is `input_template.format(prompt)` tokenised without special tokens, preceded by bos when
    `add_bos` (the demo tokenizer never adds bos itself), or the chat template with a generation prompt when
    `use_chat_template`. Decoding stops at eos or after `max_new_tokens`.
    """
    if not records:
        return ExactMatchResult(accuracy=0.0, n=0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    pairs = [_prompt_and_answer(r) for r in records]
    prompt_ids = [_prompt_ids(tokenizer, p, input_template, add_bos, use_chat_template) for p, _ in pairs]
    # Batch prompts of similar length together: less padding, same results.
    order = sorted(range(len(records)), key=lambda i: len(prompt_ids[i]))
    responses: list[str] = [""] * len(records)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            outs = _greedy_batch(model, [prompt_ids[i] for i in chunk], pad_id, eos_id, max_new_tokens)
            for i, ids in zip(chunk, outs):
                responses[i] = tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        model.train(was_training)
    hits = [is_correct(resp, answer) for resp, (_, answer) in zip(responses, pairs)]
    by_task: dict[str, list[bool]] = defaultdict(list)
    for record, hit in zip(records, hits):
        by_task[str(record.get("task", "all"))].append(hit)
    return ExactMatchResult(accuracy=sum(hits) / len(hits), n=len(hits),
                            per_task={t: sum(h) / len(h) for t, h in sorted(by_task.items())},
                            responses=responses)


def exact_match(model, tokenizer, records: Sequence[Mapping], input_template: str | None = DEMO_INPUT_TEMPLATE,
                max_new_tokens: int = 8, batch_size: int = 64, add_bos: bool = True) -> float:
    """Fraction of `records` the model answers exactly (greedy). See `evaluate_exact_match` for per-task."""
    return evaluate_exact_match(model, tokenizer, records, input_template, max_new_tokens, batch_size,
                                add_bos).accuracy
