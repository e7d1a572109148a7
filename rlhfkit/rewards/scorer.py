"""A trained reward model as a scorer of texts: bos + text + eos (added when missing), the last `max_len` tokens
kept, the reward read at the last token (`sequence_rewards`), optionally normalised with the `reward_mean` /
`reward_std` that train_rm saved. Served over HTTP by rlhfkit/rewards/server.py and used by batch inference.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.data.tokens import encode, with_bos, with_eos
from rlhfkit.errors import UserError
from rlhfkit.models.value_model import sequence_rewards


class RewardScorer:
    """Texts -> rewards with one reward model (not thread-safe: the server calls it from its worker only)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_len: int = 2048, normalize: bool | None = None,
                 batch_size: int = 16):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 (got {max_len})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        config = model.config
        self.normalize = bool(getattr(config, "normalize_reward", False)) if normalize is None else normalize
        if self.normalize and not all(hasattr(config, k) for k in ("reward_mean", "reward_std")):
            raise UserError("--normalize_reward: the model config has no reward_mean / reward_std (save it with "
                            "rlhfkit.cli.train_rm, or drop the flag)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.batch_size = batch_size
        self.device = next(model.parameters()).device

    def token_ids(self, text: str) -> list[int]:
        ids = with_eos(self.tokenizer, with_bos(self.tokenizer, encode(self.tokenizer, text)))
        return ids[-self.max_len:]

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        rewards: list[float] = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(texts), self.batch_size):
            rows = [self.token_ids(t) for t in texts[start:start + self.batch_size]]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
                attention_mask[i, :len(r)] = 1
            batch = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
            rewards.extend(sequence_rewards(self.model, batch, normalize=self.normalize).float().cpu().tolist())
        return rewards


def refuse_vision_reward_model(path: str) -> None:
    """A UserError for a vision-language reward model: a RewardScorer scores texts, so it would score that model's
    inputs without their images (the RL commands score image samples in-process, with `--reward_pretrain`)."""
    from transformers import AutoConfig

    from rlhfkit.models.vision import is_vision_config

    if is_vision_config(AutoConfig.from_pretrained(path)):
        raise UserError(f"--reward_pretrain {path} is a vision-language reward model, and serve_rm and batch_inference "
                        "score texts without images; score image samples in train_ppo / train_ppo_ray "
                        "(--reward_pretrain there)")


def load_scorer(path: str, *, value_head_prefix: str = "score", max_len: int = 2048, normalize: bool | None = None,
                batch_size: int = 16, bf16: bool = False, attn_implementation: str = "sdpa",
                use_fast_tokenizer: bool = True) -> RewardScorer:
    """A RewardScorer for the reward model saved in `path` (on the GPU when there is one)."""
    from rlhfkit.models.loading import check_model_path, load_tokenizer
    from rlhfkit.models.value_model import load_value_model

    path = check_model_path(path, "--reward_pretrain")
    refuse_vision_reward_model(path)
    tokenizer = load_tokenizer(path, use_fast=use_fast_tokenizer, flag="--reward_pretrain")
    model = load_value_model(path, value_head_prefix=value_head_prefix, attn_implementation=attn_implementation,
                             dtype=torch.bfloat16 if bf16 else torch.float32, flag="--reward_pretrain")
    model.requires_grad_(False)
    if torch.cuda.is_available():
        model = model.cuda()  # type: ignore[call-arg]  # transformers' @wraps(Module.cuda) types away `self`
    return RewardScorer(model, tokenizer, max_len=max_len, normalize=normalize, batch_size=batch_size)
