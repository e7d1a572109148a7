"""Images in agent episodes (a vision-language policy with `--image_key`): the prompt's images, and images an
agent's `step` returns with its feedback (`"environment_images"`: a list of anything an `--image_key` record may hold,
or PIL images), which join the episode's context in token-in-token-out form, as OpenRLHF's multi-turn VLM example
does.

A feedback's images go where its text has `<image>` markers (one per image), else at its start. Each becomes the
model's placeholder, is tokenised with the feedback, and its image-pad token is repeated once per vision token
(`rlhfkit.data.images`): exact ids, action mask 0 like all feedback. The episode keeps every image it has seen in
context order, hands them to the engine with each turn's context, and to the trainer with the finished sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.data.images import RecordImages, decode_image, mark_images

Pixels = dict[str, torch.Tensor]


def merge_pixels(parts: Sequence[Pixels]) -> Pixels | None:
    """Several images' pixel tensors as one (patches and grid lines in order); None for none."""
    if not parts:
        return None
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


class EpisodeImages:
    """The images of concurrent episodes (by episode index) and the reader that turns new ones into tokens and
    pixels (`reader`: the run's `RecordImages`; None for a text policy, which refuses image feedback)."""

    def __init__(self, reader: RecordImages | None):
        self.reader = reader
        self.by_episode: dict[int, list[Pixels]] = {}

    def start(self, episode: int, prompt_pixels: Pixels | None) -> None:
        """An episode begins with its prompt's images (if any)."""
        self.by_episode[episode] = [prompt_pixels] if prompt_pixels is not None else []

    def feedback_ids(self, tokenizer: Any, text: str, images: Sequence[Any], where: str) -> tuple[list[int], Pixels]:
        """(token ids, pixels) of a feedback text with its images: placeholders marked and expanded per vision
        token. A policy without images refuses them (the agent's failure, raised as ValueError)."""
        if self.reader is None:
            raise ValueError("step returned environment_images, but the policy takes no images: train a "
                             "vision-language --pretrain with --image_key")
        decoded = [image.convert("RGB") if hasattr(image, "convert") else decode_image(image, where)
                   for image in images]
        marked = mark_images(text, len(decoded), self.reader.tokens.placeholder, where, "environment_feedback")
        ids = tokenizer.encode(marked, add_special_tokens=False)
        pixels = self.reader.pixels(decoded)
        return self.reader.expand(ids, [0] * len(ids), pixels, where)[0], pixels

    def keep(self, episode: int | None, pixels: Pixels) -> None:
        """Feedback images that joined the episode's context."""
        if episode is not None:
            self.by_episode.setdefault(episode, []).append(pixels)

    def of(self, episode: int | None) -> Pixels | None:
        """Every image of the episode's context so far, merged (None: none)."""
        return merge_pixels(self.by_episode.get(episode, [])) if episode is not None else None
