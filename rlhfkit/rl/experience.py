"""The experience of an RL step: sampled sequences and everything scored and computed about them.

Layout (one row per sample; the samples of one prompt are adjacent):
- `sequences [B, T]`: prompt tokens then response tokens, right-padded (docs/CONVENTIONS.md); `attention_mask
  [B, T]` marks real tokens; `prompt_lengths [B]` says where each response starts.
- action tensors `[B, R]`, R the longest response: entry j of row i is about response token j (the j-th action).
  `action_mask` marks real response tokens (eos included); response token j sits at sequence position
  prompt_length + j and is predicted by the logits at position prompt_length + j - 1 (`action_positions`).
  `action_log_probs` (the actor before this step's update: PPO's old policy), `rollout_log_probs` (what the rollout
  engine reported), `base_action_log_probs` (reference), `values` (critic), `advantages`, `returns`, `kl`,
  `teacher_log_probs` (an on-policy distillation teacher); `teacher_topk_ids` and `teacher_topk_log_probs` are
  [B, R, k]: the teacher's k most likely tokens at each response position.
- `rewards [B]`: the scalar reward used for the advantages (after clipping); `info`: per-sample numbers [B] for
  metrics (response_length, truncated, reward (raw), score).
- `images`: image prompts (`--image_key`): per row, its images' {"pixel_values", "image_grid_thw"} (None for a row
  without images); a list, since rows hold different numbers of vision patches. Every forward gets them with the
  rows (`model_inputs`).
Every field is a CPU tensor (or None, or the list of tensor dicts), so an experience crosses a process boundary as
`to_dict()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.data.packing import pack_padded, packed_index
from rlhfkit.rollout.engine import FINISH_LENGTH, SampledSequence

ACTION_FIELDS = ("action_mask", "action_log_probs", "rollout_log_probs", "base_action_log_probs", "values",
                 "advantages", "returns", "kl", "teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs")
SEQUENCE_FIELDS = ("sequences", "attention_mask")
RowImages = dict[str, torch.Tensor] | None  # one row's images (Qwen2-VL: pixel_values, image_grid_thw) or None


def batch_images(rows: Sequence[RowImages]) -> dict[str, torch.Tensor]:
    """The rows' images as one forward takes them: every image's patches one after another in row order, one
    `image_grid_thw` line per image ({} when no row has images)."""
    present = [r for r in rows if r]
    if not present:
        return {}
    return {key: torch.cat([r[key] for r in present]) for key in present[0]}


def pad_columns(t: torch.Tensor, width: int, value: float | int = 0) -> torch.Tensor:
    """t [B, C, ...] padded with `value` to [B, width, ...]."""
    if t.shape[1] >= width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def last_action_column(action_mask: torch.Tensor) -> int:
    """1 + the last response column any row has an action in (0 for none). Not the count of actions: an agent
    episode's feedback tokens are mask-0 columns between its turns' actions."""
    if action_mask.numel() == 0:
        return 0
    columns = torch.arange(1, action_mask.shape[1] + 1, device=action_mask.device)
    return int((action_mask.long() * columns).max())


def action_positions(prompt_lengths: torch.Tensor, num_actions: int, seq_len: int) -> torch.Tensor:
    """[B, R] index of the position whose logits predict response token j: prompt_length + j - 1 (clamped)."""
    steps = torch.arange(num_actions, device=prompt_lengths.device)
    return (prompt_lengths[:, None] - 1 + steps[None, :]).clamp(0, max(seq_len - 2, 0))


def gather_actions(per_position: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pick per-position values [B, T, ...] at action positions [B, R] -> [B, R, ...]."""
    rows = torch.arange(per_position.shape[0], device=per_position.device)[:, None]
    return per_position[rows, positions]


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    action_mask: torch.Tensor
    action_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    base_action_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_log_probs: torch.Tensor | None = None
    info: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[RowImages] | None = None

    # -- basic shape --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    def action_positions(self) -> torch.Tensor:
        return action_positions(self.prompt_lengths, self.num_actions, self.sequences.shape[1])

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The padded batch a model forward takes (docs/CONVENTIONS.md), with the rows' images if they have some."""
        return {"input_ids": self.sequences, "attention_mask": self.attention_mask,
                **batch_images(self.images or [])}

    def packed_inputs(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The rows packed into one (`--packing_samples`, docs/CONVENTIONS.md) and the packed position [B, R] whose
        output predicts each response token (clamped into its own sample where action_mask is 0). The rows' images
        follow in row order, the order they are packed in."""
        batch, offsets = pack_padded(self.sequences, self.attention_mask)
        index = packed_index(offsets, self.action_positions(), self.attention_mask.long().sum(dim=1))
        return {**batch, **batch_images(self.images or [])}, index

    def action_tokens(self) -> torch.Tensor:
        """[B, R] the response token ids (garbage where action_mask is 0)."""
        rows = torch.arange(len(self), device=self.sequences.device)[:, None]
        return self.sequences[rows, (self.action_positions() + 1).clamp(max=self.sequences.shape[1] - 1)]

    # -- conversions --------------------------------------------------------------------------------------
    def _map(self, fn: Any, images: list[RowImages] | None = None) -> Experience:
        values: dict[str, Any] = {f.name: (fn(getattr(self, f.name)) if getattr(self, f.name) is not None else None)
                  for f in dataclasses.fields(self) if f.name not in ("info", "images")}
        return Experience(**values, info={k: fn(v) for k, v in self.info.items()}, images=images)

    def to(self, device: torch.device | str) -> Experience:
        images = None if self.images is None else [
            None if r is None else {k: v.to(device) for k, v in r.items()} for r in self.images]
        return self._map(lambda t: t.to(device), images)

    def select(self, rows: torch.Tensor | list[int] | slice) -> Experience:
        """The experience of some rows (a slice, or a list / tensor of indices)."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long)
        images = None
        if self.images is not None:
            images = self.images[rows] if isinstance(rows, slice) else [self.images[i] for i in rows.tolist()]
        return self._map(lambda t: t[rows], images)

    def trimmed(self) -> Experience:
        """Drop padding columns beyond the longest sequence and response of these rows (less compute)."""
        seq_len = int(self.attention_mask.sum(dim=1).max()) if len(self) else 0
        num_actions = max(last_action_column(self.action_mask), 1)
        out = dataclasses.replace(self, info=dict(self.info))
        for name in SEQUENCE_FIELDS:
            setattr(out, name, getattr(self, name)[:, :max(seq_len, 2)])
        for name in ACTION_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value[:, :num_actions])
        return out

    def split(self, micro_batch_size: int) -> list[Experience]:
        """Consecutive micro-batches of `micro_batch_size` rows, each trimmed of padding."""
        return [self.select(slice(i, i + micro_batch_size)).trimmed()
                for i in range(0, len(self), micro_batch_size)]

    @staticmethod
    def concat(parts: list[Experience]) -> Experience:
        """Stack experiences (padding sequences and actions to the widest); optional fields must agree."""
        if not parts:
            raise ValueError("Experience.concat needs at least one experience")
        seq_len = max(p.sequences.shape[1] for p in parts)
        num_actions = max(p.num_actions for p in parts)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(Experience):
            if f.name in ("info", "images"):
                continue
            items = [getattr(p, f.name) for p in parts]
            if all(t is None for t in items):
                values[f.name] = None
                continue
            if any(t is None for t in items):
                raise ValueError(f"Experience.concat: {f.name} is set in some experiences but not all")
            if f.name in SEQUENCE_FIELDS:
                items = [pad_columns(t, seq_len) for t in items]
            elif f.name in ACTION_FIELDS:
                items = [pad_columns(t, num_actions) for t in items]
            values[f.name] = torch.cat(items, dim=0)
        keys = set(parts[0].info)
        info = {k: torch.cat([p.info[k] for p in parts], dim=0) for k in keys if all(k in p.info for p in parts)}
        images = None
        if any(p.images is not None for p in parts):
            images = [row for p in parts for row in (p.images if p.images is not None else [None] * len(p))]
        return Experience(**values, info=info, images=images)

    def to_dict(self) -> dict[str, Any]:
        """Plain {name: tensor} (None fields left out; info under "info"), for role methods and Ray."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                               if f.name != "info" and getattr(self, f.name) is not None}
        out["info"] = dict(self.info)
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Experience:
        names = {f.name for f in dataclasses.fields(Experience)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"Experience.from_dict: unknown field(s) {sorted(unknown)}")
        return Experience(**{k: v for k, v in data.items() if k != "info"}, info=dict(data.get("info") or {}))


def _action_mean(sample: SampledSequence) -> float:
    """The mean policy version of a sample's action tokens (an agent's feedback tokens are not trained)."""
    versions = sample.versions or []
    mask = sample.action_mask or [1] * len(versions)
    acted = [v for v, m in zip(versions, mask) if m]
    return sum(acted) / len(acted) if acted else float(min(versions, default=-1))


def experience_from_samples(samples: Sequence[SampledSequence], pad_id: int,
                            images: Sequence[RowImages] | None = None) -> Experience:
    """Pad sampled sequences into an Experience: sequences, masks, rollout log-probs, per-sample info, and the
    samples' images (`images`, one entry per sample; None: a text-only batch)."""
    if not samples:
        raise ValueError("no samples")
    if images is None and any(s.images is not None for s in samples):  # agent episodes bring their own
        images = [s.images for s in samples]
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len, num_actions = max(lengths), max(max(len(s.response_ids) for s in samples), 1)
    batch = len(samples)
    sequences = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)
    action_mask = torch.zeros((batch, num_actions), dtype=torch.bool)
    rollout_log_probs = torch.zeros((batch, num_actions), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = list(s.prompt_ids) + list(s.response_ids)
        sequences[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :len(ids)] = 1
        if s.action_mask is None:
            action_mask[i, :len(s.response_ids)] = True
        else:  # an agent episode: feedback tokens are context, never actions (no loss, no KL, no value target)
            action_mask[i, :len(s.action_mask)] = torch.tensor(s.action_mask, dtype=torch.bool)
        if s.logprobs:
            rollout_log_probs[i, :len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
    info = {
        "response_length": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32),
        "truncated": torch.tensor([s.finish_reason == FINISH_LENGTH for s in samples], dtype=torch.float32),
    }
    versions = [s.versions for s in samples if s.versions is not None]
    if samples and len(versions) == len(samples):  # async: oldest and newest sampling policy
        info["policy_version"] = torch.tensor([min(v, default=-1) for v in versions], dtype=torch.float32)
        info["policy_version_max"] = torch.tensor([max(v, default=-1) for v in versions], dtype=torch.float32)
        info["policy_version_mean"] = torch.tensor([_action_mean(s) for s in samples], dtype=torch.float32)
    return Experience(sequences=sequences, attention_mask=attention_mask,
                      prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
                      action_mask=action_mask, rollout_log_probs=rollout_log_probs, info=info,
                      images=list(images) if images is not None and any(images) else None)


def as_experience(batch: Experience | dict[str, Any]) -> Experience:
    """Role methods accept an Experience or its `to_dict()`."""
    return batch if isinstance(batch, Experience) else Experience.from_dict(batch)
