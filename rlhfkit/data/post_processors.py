"""Scored samples -> training data: rejection sampling, conditional SFT and DPO pairs (`batch_inference
--post_processor rs | csft | iter_dpo`).

A scored sample is a dict {"input": the record's prompt (text, or a message list), "output": response text,
"reward": float}. Samples belong to the same prompt when their inputs are equal. The prompt stays as the record
held it (no template applied), so the trainer that reads the result formats it exactly as generation did when it
is given the same `--input_template` / `--apply_chat_template` flags.

- Rejection sampling (best-of-n; Touvron et al. 2023, "Llama 2", arXiv:2307.09288, section 3.2.2): each
  prompt's highest-reward response becomes an SFT record {"input", "output", "reward"}.
- Conditional SFT (Hu et al. 2023, "Aligning Language Models with Offline Learning from Human Feedback",
  arXiv:2308.12050; OpenRLHF's csft): every sample is kept and its reward (or reward bucket) is written into the
  prompt with a template such as "{input} <rm_score>: {reward} ", so at inference a high score can be asked for.
- Iterative DPO pairs (Xiong et al. 2024, "Iterative Preference Learning from Human Feedback",
  arXiv:2312.11456): per prompt the best response is chosen and the worst rejected; prompts whose responses all
  score the same give no pair.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

Sample = dict[str, Any]


def prompt_key(value: Any) -> str:
    """A hashable identity of a prompt (text or message list) for grouping samples."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def group_by_prompt(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples grouped by prompt, groups in order of first appearance, samples in their order."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(prompt_key(sample["input"]), []).append(sample)
    return list(groups.values())


def normalize_rewards(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / std over all rewards (std with n - 1, as torch.std); with no spread only the mean is removed."""
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    var = math.fsum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    std = math.sqrt(var)
    return [(r - mean) / std if std > 0 else r - mean for r in rewards]


def rejection_sampling(samples: Sequence[Sample]) -> list[Sample]:
    """Each prompt's highest-reward sample (the first of equals) as {"input", "output", "reward"}."""
    out = []
    for group in group_by_prompt(samples):
        best = max(group, key=lambda s: s["reward"])  # max keeps the first of equal rewards
        out.append({"input": best["input"], "output": best["output"], "reward": best["reward"]})
    return out


def quantile_buckets(rewards: Sequence[float], num_buckets: int) -> list[int]:
    """Bucket 1..num_buckets of each reward by rank: 1 + floor(num_buckets x (#rewards strictly lower) / n).

    Equal rewards share a bucket; with distinct rewards each bucket holds about n / num_buckets of them."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1 (got {num_buckets})")
    ordered = sorted(rewards)
    n = len(rewards)
    return [1 + (num_buckets * bisect.bisect_left(ordered, r)) // n for r in rewards]


def edit_prompt(value: Any, edit: Callable[[str], str]) -> Any:
    """Apply `edit` to a prompt: a string, or the content of the last user message of a message list."""
    if isinstance(value, str):
        return edit(value)
    messages = [dict(m) for m in value]
    for message in reversed(messages):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            message["content"] = edit(message["content"])
            return messages
    raise ValueError("the prompt has no user message with text content to put the condition in")


def conditional_sft(samples: Sequence[Sample], template: str, num_buckets: int = 0) -> list[Sample]:
    """Every sample with its reward written into its prompt through `template` ({input}, {reward}).

    {reward} becomes the reward with two decimals, or with `num_buckets` > 0 its quantile bucket (1 = lowest).
    The reward is substituted first, so an {input} that itself contains "{reward}" is left alone."""
    rewards = [s["reward"] for s in samples]
    tags = [str(b) for b in quantile_buckets(rewards, num_buckets)] if num_buckets else \
        [f"{r:.2f}" for r in rewards]
    out = []
    for sample, tag in zip(samples, tags):
        filled = template.replace("{reward}", tag)
        fill_input = functools.partial(str.replace, filled, "{input}")  # text -> `filled` with text for {input}
        out.append({"input": edit_prompt(sample["input"], fill_input),
                    "output": sample["output"], "reward": sample["reward"], "condition": tag})
    return out


def dpo_pairs(samples: Sequence[Sample]) -> tuple[list[Sample], int]:
    """(pairs, prompts dropped): per prompt {"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}
    from its highest and lowest reward sample (first of equals); a prompt whose samples all tie is dropped."""
    pairs, dropped = [], 0
    for group in group_by_prompt(samples):
        best = max(group, key=lambda s: s["reward"])
        worst = min(group, key=lambda s: s["reward"])
        if not best["reward"] > worst["reward"]:
            dropped += 1
            continue
        pairs.append({"prompt": best["input"], "chosen": best["output"], "rejected": worst["output"],
                      "chosen_reward": best["reward"], "rejected_reward": worst["reward"]})
    return pairs, dropped
