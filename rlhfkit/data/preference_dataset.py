"""Preference pairs (reward models, DPO) and unpaired labelled completions (KTO), tokenised.

A sample keeps its parts: prompt_ids (bos included), and response ids (eos included), so a trainer can build
prompt+response rows (`collate.pair_collate`, `collate.unpaired_collate`) with the loss mask on the response.
Responses are cut at the end to fit `max_len` with their prompt; a sample whose prompt alone fills `max_len`
is dropped (`num_dropped`), and when all are dropped that is a UserError.

Text forms: without a chat template, responses are strings appended to the `--input_template`d prompt (no
prompt key: an empty prompt). With `--apply_chat_template`, the prompt is record[prompt_key] (string or
messages) and each response a string or messages; without a prompt key, chosen and rejected are whole
conversations and the prompt is their shared prefix messages[:-1].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.data.images import RecordImages
from rlhfkit.data.templates import (
    PromptFormatter,
    as_messages,
    describe,
    locate,
    prompt_and_response,
    require_field,
)
from rlhfkit.data.tokens import as_long, encode, sources_of, with_bos, with_eos
from rlhfkit.errors import UserError


class _PromptResponses:
    """Token ids of one prompt and several responses to it, in the text form the flags ask for."""

    def __init__(self, tokenizer: Any, input_template: str | None, apply_chat_template: bool,
                 tokenizer_chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat = apply_chat_template
        self.format_prompt = PromptFormatter(tokenizer, input_template, apply_chat_template, tokenizer_chat_template)

    def __call__(self, prompt: Any, responses: list[tuple[Any, str]], where: str,
                 prompt_flag: str) -> tuple[list[int], list[list[int]]]:
        tok = self.tokenizer
        if not self.chat:
            text = "" if prompt is None else self.format_prompt(prompt, where, prompt_flag)
            for value, flag in responses:
                if not isinstance(value, str):
                    raise UserError(f"{where}: {flag} holds {describe(value)}, not text; fix the record (or, "
                                    "for message lists, pass --apply_chat_template)")
            return (with_bos(tok, encode(tok, text)),
                    [with_eos(tok, encode(tok, value)) for value, _ in responses])
        if prompt is not None:
            prompt_msgs = as_messages(prompt, "user", where, prompt_flag)
            response_msgs = [as_messages(v, "assistant", where, flag) for v, flag in responses]
        else:
            conversations = [as_messages(v, "assistant", where, flag) for v, flag in responses]
            prompt_msgs = conversations[0][:-1]
            if any(c[:-1] != prompt_msgs for c in conversations):
                raise UserError(f"{where}: the responses do not share the same prompt messages (all but the "
                                f"last); give the prompt separately with {prompt_flag}")
            response_msgs = [c[-1:] for c in conversations]
        rendered = [prompt_and_response(tok, prompt_msgs, msgs, where) for msgs in response_msgs]
        prompt_text = rendered[0][0]
        return (with_bos(tok, encode(tok, prompt_text)),
                [with_eos(tok, encode(tok, text), anywhere=True) for _, text in rendered])


class _TruncatingDataset:
    """Shared bookkeeping: cut responses to fit max_len, count and explain dropped samples."""

    def __init__(self, max_len: int, images: RecordImages | None = None):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 (got {max_len}): a sample needs a token and the one it predicts")
        self.max_len = max_len
        self.images = images  # --image_key: the prompt's images; samples also carry their pixel tensors
        self.samples: list[dict[str, Any]] = []
        self._dropped = 0
        self._shortest_need: int | None = None

    def _fit(self, prompt_ids: list[int], responses: list[list[int]]) -> list[torch.Tensor] | None:
        budget = self.max_len - len(prompt_ids)
        if budget < 1:
            self._dropped += 1
            need = len(prompt_ids) + 1
            self._shortest_need = need if self._shortest_need is None else min(self._shortest_need, need)
            return None
        return [as_long(r[:budget]) for r in responses]

    def _with_images(self, record: Any, key: str | None, flag: str, where: str
                     ) -> tuple[Any, dict[str, torch.Tensor] | None]:
        """The record with its images' placeholders in the prompt field `key`, and their pixels (None without)."""
        if self.images is None:
            return record, None
        images = self.images.read(record, where)
        if not images:
            return record, None
        if key is None:
            raise UserError(f"{where} has images but no prompt field to put them in; set {flag}")
        return self.images.marked(record, key, len(images), where, flag), self.images.pixels(images)

    def _expand(self, prompt_ids: list[int], pixels: dict[str, torch.Tensor] | None, where: str) -> list[int]:
        """The prompt ids with each image-pad token repeated for its vision tokens."""
        if pixels is None or self.images is None:
            return prompt_ids
        return self.images.expand(prompt_ids, [0] * len(prompt_ids), pixels, where)[0]

    def _check_not_empty(self, records: Sequence[Any]) -> None:
        if self.samples:
            return
        if not records:
            raise UserError("no records to tokenise (the dataset is empty)")
        raise UserError(f"--max_len {self.max_len} is too small for any sample in {sources_of(records)} "
                        f"(shortest needs {self._shortest_need} tokens)")

    @property
    def num_dropped(self) -> int:
        """Samples whose prompt alone fills --max_len."""
        return self._dropped

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]


class PreferenceDataset(_TruncatingDataset):
    """`dataset[i]` is {"prompt_ids", "chosen_ids", "rejected_ids": LongTensor, "margin": float (0.0 unless
    margin_key)}; batch with `collate.pair_collate`."""

    def __init__(self, records: Sequence[Any], tokenizer: Any, max_len: int, *, prompt_key: str | None = None,
                 chosen_key: str = "chosen", rejected_key: str = "rejected", margin_key: str | None = None,
                 input_template: str | None = None, apply_chat_template: bool = False,
                 tokenizer_chat_template: str | None = None, images: RecordImages | None = None):
        super().__init__(max_len, images)
        encode_pair = _PromptResponses(tokenizer, input_template, apply_chat_template, tokenizer_chat_template)
        for i, record in enumerate(records):
            where = locate(record, i)
            record, pixels = self._with_images(record, prompt_key, "--prompt_key", where)
            prompt = require_field(record, prompt_key, where, "--prompt_key") if prompt_key else None
            chosen = require_field(record, chosen_key, where, "--chosen_key")
            rejected = require_field(record, rejected_key, where, "--rejected_key")
            if chosen == rejected:
                raise UserError(f"{where}: the {chosen_key!r} and {rejected_key!r} responses are identical, so the "
                                f"pair says nothing about preference; fix or remove this record")
            prompt_ids, responses = encode_pair(prompt, [(chosen, "--chosen_key"), (rejected, "--rejected_key")],
                                                where, "--prompt_key")
            prompt_ids = self._expand(prompt_ids, pixels, where)
            fitted = self._fit(prompt_ids, responses)
            if fitted is None:
                continue
            margin = _number(require_field(record, margin_key, where, "--margin_key"), where, "--margin_key") \
                if margin_key else 0.0
            self.samples.append({"prompt_ids": as_long(prompt_ids), "chosen_ids": fitted[0],
                                 "rejected_ids": fitted[1], "margin": margin, **(pixels or {})})
        self._check_not_empty(records)

    @classmethod
    def from_args(cls, records: Sequence[Any], tokenizer: Any, args: Any,
                  images: RecordImages | None = None) -> PreferenceDataset:
        """Build from a config with DataArgs fields plus prompt_key/chosen_key/rejected_key (margin_key)."""
        return cls(records, tokenizer, args.max_len, prompt_key=getattr(args, "prompt_key", None),
                   chosen_key=getattr(args, "chosen_key", "chosen"),
                   rejected_key=getattr(args, "rejected_key", "rejected"),
                   margin_key=getattr(args, "margin_key", None), input_template=args.input_template,
                   apply_chat_template=args.apply_chat_template,
                   tokenizer_chat_template=args.tokenizer_chat_template, images=images)


class UnpairedDataset(_TruncatingDataset):
    """KTO data: `dataset[i]` is {"prompt_ids", "response_ids": LongTensor, "label": 1 (desirable) or 0};
    batch with `collate.unpaired_collate`."""

    def __init__(self, records: Sequence[Any], tokenizer: Any, max_len: int, *, input_key: str = "input",
                 output_key: str = "output", label_key: str = "label", input_template: str | None = None,
                 apply_chat_template: bool = False, tokenizer_chat_template: str | None = None,
                 images: RecordImages | None = None):
        super().__init__(max_len, images)
        encode_one = _PromptResponses(tokenizer, input_template, apply_chat_template, tokenizer_chat_template)
        for i, record in enumerate(records):
            where = locate(record, i)
            record, pixels = self._with_images(record, input_key, "--input_key", where)
            prompt = require_field(record, input_key, where, "--input_key")
            output = require_field(record, output_key, where, "--output_key")
            label = _label(require_field(record, label_key, where, "--label_key"), where)
            prompt_ids, responses = encode_one(prompt, [(output, "--output_key")], where, "--input_key")
            prompt_ids = self._expand(prompt_ids, pixels, where)
            fitted = self._fit(prompt_ids, responses)
            if fitted is not None:
                self.samples.append({"prompt_ids": as_long(prompt_ids), "response_ids": fitted[0], "label": label,
                                     **(pixels or {})})
        self._check_not_empty(records)

    @classmethod
    def from_args(cls, records: Sequence[Any], tokenizer: Any, args: Any,
                  images: RecordImages | None = None) -> UnpairedDataset:
        return cls(records, tokenizer, args.max_len, input_key=args.input_key,
                   output_key=args.output_key or "output", label_key=getattr(args, "label_key", None) or "label",
                   input_template=args.input_template, apply_chat_template=args.apply_chat_template,
                   tokenizer_chat_template=args.tokenizer_chat_template, images=images)


def _number(value: Any, where: str, flag: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {flag} holds {value!r}, not a number") from None


_TRUE = {"true", "1", "yes", "desirable", "good"}
_FALSE = {"false", "0", "no", "undesirable", "bad"}


def _label(value: Any, where: str) -> int:
    """KTO label: True/1/"true" -> 1 (desirable), False/0/"false" -> 0."""
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return int(value.strip().lower() in _TRUE)
    raise UserError(f"{where}: --label_key holds {value!r}; KTO labels are true/false (or 1/0)")
