"""Independent reference outputs computed with plain Transformers in the test process."""

from __future__ import annotations

from pathlib import Path

import torch


def load_with_state(model_dir, state: dict | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int, eos_token_id: int) -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding), stopping after eos like vLLM."""
    out = []
    for ids in prompt_ids:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        out.append(seq[0, len(ids):].tolist())
    return out


@torch.no_grad()
def response_logits(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """[len(response), vocab] float64 logits predicting each response token from its prefix."""
    ids = torch.tensor([prompt_ids + response_ids])
    return model(ids).logits[0, len(prompt_ids) - 1:-1].double()


def hf_token_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log p(response token | prefix) at temperature 1, float64."""
    logits = response_logits(model, prompt_ids, response_ids)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def demo_prompt_ids(model_dir, n: int) -> list[list[int]]:
    import json

    from transformers import AutoTokenizer

    from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    data = Path(model_dir).parent / "data" / "rl_train.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()][:n]
    return [tok(DEMO_INPUT_TEMPLATE.format(r["prompt"]))["input_ids"] for r in rows]


def greedy_gaps(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """At each response position, how far the response token's logit is below `model`'s top logit (0 where the
    token is `model`'s greedy choice): checks a greedy response from an engine computing in another precision."""
    if not response_ids:
        return []
    logits = response_logits(model, prompt_ids, response_ids)
    chosen = logits.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
    return (logits.max(-1).values - chosen).tolist()
