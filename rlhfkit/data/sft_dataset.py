"""SFT samples: records -> {"input_ids", "loss_mask"} with the loss on the response (and its eos) only.

Four shapes of record, chosen by flags:
- plain (default): prompt = `--input_template` applied to record[input_key]; response = record[output_key];
  sample = [bos] + prompt + response + [eos], targets: response and eos;
- `--apply_chat_template`: input_key holds a prompt string or a message list, output_key a response string or
  message list (without --output_key, the last message of the input list is the response); the prompt is
  rendered with the generation prompt, the response is what the full rendering adds (its end-of-turn included);
- `--multiturn`: input_key holds the whole conversation; every assistant turn is a target (found by rendering
  successive prefixes, see `templates.chat_segments`);
- `--pretrain_mode`: the raw text, no --input_template (prompt + response if --output_key is set), every token a
  target.
Samples longer than `--max_len` are cut at the end; a sample left with no target token is dropped
(`num_dropped`), and when every sample is dropped that is a UserError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.data.images import RecordImages
from rlhfkit.data.templates import (
    PromptFormatter,
    as_messages,
    chat_segments,
    describe,
    locate,
    prompt_and_response,
    render_chat,
    require_field,
)
from rlhfkit.data.tokens import Piece, encode, first_target, join_pieces, sources_of, token_sample, with_bos, with_eos
from rlhfkit.errors import UserError


class SFTDataset:
    """Tokenised SFT samples; `dataset[i]` is {"input_ids": LongTensor[L], "loss_mask": LongTensor[L]}."""

    def __init__(self, records: Sequence[Any], tokenizer: Any, max_len: int, *, input_key: str = "input",
                 output_key: str | None = None, input_template: str | None = None,
                 apply_chat_template: bool = False, tokenizer_chat_template: str | None = None,
                 multiturn: bool = False, pretrain_mode: bool = False, images: RecordImages | None = None):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 (got {max_len}): a sample needs a token and the one it predicts")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.input_key = input_key
        self.output_key = output_key
        self.multiturn = multiturn
        self.pretrain_mode = pretrain_mode
        self.chat = apply_chat_template or multiturn
        self.images = images  # --image_key: samples also carry pixel_values and image_grid_thw
        # continued pretraining reads the raw text: no template (OpenRLHF's SFT dataset drops it there too)
        template = None if pretrain_mode else input_template
        self.format_prompt = PromptFormatter(tokenizer, template, self.chat, tokenizer_chat_template)
        self.samples: list[dict[str, torch.Tensor]] = []
        self._dropped_too_long = 0
        self._dropped_no_target = 0
        shortest_need: int | None = None
        for i, record in enumerate(records):
            where = locate(record, i)
            record, pixels = self._with_images(record, where)
            ids, mask = join_pieces(self._pieces(record, where))
            if pixels is not None and self.images is not None:
                ids, mask = self.images.expand(ids, mask, pixels, where)
            start = first_target(mask)
            if start is None:
                self._dropped_no_target += 1
                continue
            # truncation from the end would cut every target token (or a part of an image's vision tokens)
            keep = start if pixels is None else max(start, _last_image_token(ids, self.images))
            if keep >= max_len:
                self._dropped_too_long += 1
                shortest_need = keep + 1 if shortest_need is None else min(shortest_need, keep + 1)
                continue
            self.samples.append({**token_sample(ids[:max_len], mask[:max_len]), **(pixels or {})})
        if not self.samples:
            self._raise_all_dropped(records, shortest_need)

    @classmethod
    def from_args(cls, records: Sequence[Any], tokenizer: Any, data_args: Any,
                  images: RecordImages | None = None) -> SFTDataset:
        """Build from a `rlhfkit.config.common.DataArgs` (and the images of --image_key)."""
        a = data_args
        return cls(records, tokenizer, a.max_len, input_key=a.input_key, output_key=a.output_key,
                   input_template=a.input_template, apply_chat_template=a.apply_chat_template,
                   tokenizer_chat_template=a.tokenizer_chat_template, multiturn=a.multiturn,
                   pretrain_mode=a.pretrain_mode, images=images)

    # -- sequence protocol ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]

    @property
    def num_dropped(self) -> int:
        """Records that gave no sample: every target cut off by --max_len, or nothing to train on."""
        return self._dropped_too_long + self._dropped_no_target

    @property
    def num_dropped_too_long(self) -> int:
        return self._dropped_too_long

    def _with_images(self, record: Any, where: str) -> tuple[Any, dict[str, torch.Tensor] | None]:
        """The record with its images' placeholders in --input_key, and their pixels (None without images)."""
        if self.images is None:
            return record, None
        images = self.images.read(record, where)
        if not images:
            return record, None
        marked = self.images.marked(record, self.input_key, len(images), where, "--input_key")
        return marked, self.images.pixels(images)

    # -- one record -----------------------------------------------------------------------------------------
    def _pieces(self, record: Any, where: str) -> list[Piece]:
        if self.multiturn:
            pieces = self._multiturn_pieces(record, where)
        elif self.pretrain_mode:
            return self._pretrain_pieces(record, where)
        elif self.chat:
            pieces = self._chat_pieces(record, where)
        else:
            pieces = self._plain_pieces(record, where)
        if self.pretrain_mode:  # multiturn text, every token a target
            pieces = [(ids, True) for ids, _ in pieces]
        return pieces

    def _field(self, record: Any, key: str | None, flag: str, where: str) -> Any:
        if key is None:
            raise UserError(f"{flag} is required for SFT (the response field); or use --pretrain_mode, or "
                            f"--apply_chat_template with message lists ending in the assistant reply ({where})")
        return require_field(record, key, where, flag)

    def _plain_pieces(self, record: Any, where: str) -> list[Piece]:
        prompt = self.format_prompt(self._field(record, self.input_key, "--input_key", where), where,
                                    f"--input_key '{self.input_key}'")
        response = self._field(record, self.output_key, "--output_key", where)
        if not isinstance(response, str):
            raise UserError(f"{where}: --output_key '{self.output_key}' holds {describe(response)}, not text; fix "
                            "the record (or, for message lists, pass --apply_chat_template)")
        if not response.strip():
            raise UserError(f"{where}: --output_key '{self.output_key}' is empty, so there is nothing to train on; "
                            "fill in the response or remove the record")
        return [(with_bos(self.tokenizer, encode(self.tokenizer, prompt)), False),
                (with_eos(self.tokenizer, encode(self.tokenizer, response)), True)]

    def _chat_pieces(self, record: Any, where: str) -> list[Piece]:
        prompt_msgs = as_messages(self._field(record, self.input_key, "--input_key", where), "user", where,
                                  "--input_key")
        if self.output_key is None:
            if len(prompt_msgs) < 2 or prompt_msgs[-1].get("role") != "assistant":
                self._field(record, None, "--output_key", where)  # raises: no response anywhere
            prompt_msgs, response_msgs = prompt_msgs[:-1], prompt_msgs[-1:]
        else:
            response_msgs = as_messages(self._field(record, self.output_key, "--output_key", where), "assistant",
                                        where, "--output_key")
        prompt, response = prompt_and_response(self.tokenizer, prompt_msgs, response_msgs, where)
        return [(with_bos(self.tokenizer, encode(self.tokenizer, prompt)), False),
                (with_eos(self.tokenizer, encode(self.tokenizer, response), anywhere=True), True)]

    def _multiturn_pieces(self, record: Any, where: str) -> list[Piece]:
        conversation = self._field(record, self.input_key, "--input_key", where)
        if not isinstance(conversation, (list, tuple)):
            raise UserError(f"{where}: --multiturn needs --input_key '{self.input_key}' to hold a list of "
                            f"messages, not a {type(conversation).__name__}")
        messages = as_messages(conversation, "user", where, "--input_key")
        pieces: list[Piece] = []
        for text, is_target in chat_segments(self.tokenizer, messages, where):
            ids = encode(self.tokenizer, text)
            pieces.append((with_eos(self.tokenizer, ids, anywhere=True) if is_target else ids, is_target))
        if pieces:
            pieces[0] = (with_bos(self.tokenizer, pieces[0][0]), pieces[0][1])
        return pieces

    def _pretrain_pieces(self, record: Any, where: str) -> list[Piece]:
        value = self._field(record, self.input_key, "--input_key", where)
        if self.chat:
            messages = as_messages(value, "user", where, "--input_key")
            if self.output_key is not None:
                messages += as_messages(self._field(record, self.output_key, "--output_key", where), "assistant",
                                        where, "--output_key")
            text = render_chat(self.tokenizer, messages, False, where)
            return [(with_bos(self.tokenizer, with_eos(self.tokenizer, encode(self.tokenizer, text), True)), True)]
        text = self.format_prompt(value, where)
        if self.output_key is not None:
            response = self._field(record, self.output_key, "--output_key", where)
            text += response if isinstance(response, str) else str(response)
        return [(with_bos(self.tokenizer, with_eos(self.tokenizer, encode(self.tokenizer, text))), True)]

    def _raise_all_dropped(self, records: Sequence[Any], shortest_need: int | None) -> None:
        files = sources_of(records)
        if not records:
            raise UserError("no SFT records to tokenise (the dataset is empty)")
        if shortest_need is not None:
            raise UserError(f"--max_len {self.max_len} is too small for any sample in {files} "
                            f"(shortest needs {shortest_need} tokens)")
        raise UserError(f"no record in {files} has a response to train on (--multiturn puts the loss on "
                        "assistant messages; none was found)")


def _last_image_token(ids: Sequence[int], images: Any) -> int:
    """Index of the last vision token in `ids` (0 when there is none)."""
    token = images.tokens.image_token_id
    return max((t for t, x in enumerate(ids) if x == token), default=0)
