"""RL prompts: records -> {"prompt": text ready for generation, "label": what the reward function checks} (and, with
`--image_key`, "images": the prompt's pixel tensors, `rlhfkit.data.images`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhfkit.data.images import RecordImages
from rlhfkit.data.templates import PromptFormatter, locate, require_field
from rlhfkit.errors import UserError


class PromptDataset:
    """`dataset[i]` is {"prompt": str, "label": record[label_key] or None}.

    The prompt is record[input_key] rendered with the chat template and its generation prompt
    (`--apply_chat_template`; a string becomes one user message, a message list is used as is), or put into
    `--input_template`, or taken as is. Tokenisation is left to the rollout source.

    With `images` (--image_key) a record's images are read and processed once here: its prompt gets the model's
    image placeholders (one image-pad token per image; the rollout source repeats it per vision token) and the
    sample carries "images" {"pixel_values", "image_grid_thw"} and "vision_tokens" (the model's image-pad token and
    merge size); a text-only record carries neither.
    """

    def __init__(self, records: Sequence[Any], tokenizer: Any = None, *, input_key: str = "input",
                 label_key: str | None = None, input_template: str | None = None,
                 apply_chat_template: bool = False, tokenizer_chat_template: str | None = None,
                 images: RecordImages | None = None):
        format_prompt = PromptFormatter(tokenizer, input_template, apply_chat_template, tokenizer_chat_template)
        self.images = images  # the image reader (also for agents' image feedback); None for text prompts
        self.samples: list[dict[str, Any]] = []
        for i, record in enumerate(records):
            where = locate(record, i)
            pixels, refs = None, None
            if images is not None:
                decoded = images.read(record, where)
                refs = images.references(record) if decoded else None
                record = images.marked(record, input_key, len(decoded), where, "--input_key")
                pixels = images.pixels(decoded) if decoded else None
            prompt = format_prompt(require_field(record, input_key, where, "--input_key"), where,
                                   f"--input_key '{input_key}'")
            label = require_field(record, label_key, where, "--label_key") if label_key is not None else None
            sample = {"prompt": prompt, "label": label}
            if pixels is not None and images is not None:  # what the rollout source needs to expand the ids
                sample.update(images=pixels, vision_tokens=images.tokens, image_refs=refs)
            self.samples.append(sample)
        if not self.samples:
            raise UserError("no prompts: the prompt dataset is empty")

    @classmethod
    def from_args(cls, records: Sequence[Any], tokenizer: Any, data_args: Any,
                  images: RecordImages | None = None) -> PromptDataset:
        """Build from DataArgs (plus `label_key` when the config has one) and the images of --image_key."""
        a = data_args
        return cls(records, tokenizer, input_key=a.input_key, label_key=getattr(a, "label_key", None),
                   input_template=a.input_template, apply_chat_template=a.apply_chat_template,
                   tokenizer_chat_template=a.tokenizer_chat_template, images=images)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]
