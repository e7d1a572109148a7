"""Images of vision-language records: read once, put into the prompt as the model's placeholders, kept as tensors.

A record names its images under `--image_key`: one value or a list, each a local path (absolute, or relative to the
working directory or to the data file), a `file://` URL, a `data:image/...;base64,` URL or a bare base64 string,
raw bytes, or a `{"bytes": ..., "path": ...}` dict (the form parquet files and `datasets` Image columns hold).

Where an image goes in the prompt: `<image>` in a plain-text prompt or in a message's text, or a `{"type": "image"}`
part of a message's content list; a prompt with no marker gets its images at the start of its first user turn. Each
marker becomes the model's placeholder text once (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`), the
chat template renders it like any text, and after tokenisation each image-pad token is repeated as many times as the
image has vision tokens (`expand_image_tokens`), so `--max_len`, token budgets and packing count vision tokens.

The image processor runs once per record when the dataset is built: a sample carries `pixel_values` [patches, dim]
and `image_grid_thw` [images, 3] (Qwen2-VL's names) next to its ids, and no image is decoded again.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from rlhfkit.errors import UserError

IMAGE_MARK = "<image>"
# What PIL reads and vision-language processors are trained on; PIL opens more (PPM, TGA, ICO, ...), refused here.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_BASE64 = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")  # no dot, so never a file name with an extension


@dataclass(frozen=True)
class VisionTokens:
    """What the data layer needs of a vision-language model (`rlhfkit.models.vision.vision_tokens` reads it from the
    model config): the image-pad token, the text one image becomes in a prompt, and the patch merge factor."""

    image_token_id: int
    placeholder: str
    merge_size: int


# -- reading one image --------------------------------------------------------------------------------------------
def _from_base64(text: str, where: str) -> bytes:
    payload = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}: image {text[:40]!r}... is neither an existing file nor valid base64") from None


def _local_path(text: str, source: str | None) -> Path | None:
    """The file `text` names (a path or file:// URL), looked up in the working directory, then next to the data."""
    if text.startswith("file://"):
        text = unquote(urlparse(text).path)
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    if source and os.path.exists(source):
        beside = Path(source).resolve().parent / text
        if beside.exists():
            return beside
    return None


def _image_bytes(value: Any, where: str, source: str | None) -> tuple[bytes, str]:
    """(the encoded image, what to call it in messages)."""
    if isinstance(value, dict):  # parquet / datasets Image feature: {"bytes": b"..." or None, "path": "..."}
        if value.get("bytes"):
            return bytes(value["bytes"]), "inline bytes"
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), "inline bytes"
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: an image is {type(value).__name__} {value!r}; give a path, a file:// URL or "
                        "base64 text")
    if value.startswith(("http://", "https://")):
        raise UserError(f"{where}: image {value} is a web URL; rlhfkit reads local files only, download it first")
    if value.startswith("data:"):
        return _from_base64(value, where), "a data URL"
    path = _local_path(value, source)
    if path is None and _BASE64.fullmatch(value) and len(value) % 4 == 0:  # no such file: base64 without data:
        return _from_base64(value, where), "base64 text"
    if path is None or not path.is_file():
        raise UserError(f"{where}: image file {value} does not exist")
    return path.read_bytes(), str(path)


def image_reference(value: Any, source: str | None = None) -> str:
    """What a reward function receives for one (already read and checked) image of a record: a local file as its
    absolute path, inline bytes (raw or a parquet / `datasets` dict's) as base64 text, a data URL or base64 text as
    given."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    text = str(value)
    if text.startswith("data:"):
        return text
    path = _local_path(text, source)
    return str(path.resolve()) if path is not None and path.is_file() else text


def decode_image(value: Any, where: str, source: str | None = None) -> Any:
    """One image of a record as an RGB PIL image; a missing, corrupt or unsupported one is a UserError naming the
    record (`where`)."""
    from PIL import Image, UnidentifiedImageError

    data, name = _image_bytes(value, where, source)
    try:
        image = Image.open(io.BytesIO(data))
        fmt = image.format or "unknown"
        if fmt not in SUPPORTED_FORMATS:
            raise UserError(f"{where}: image {name} is in the unsupported format {fmt}; use one of "
                            f"{', '.join(SUPPORTED_FORMATS)}")
        image.load()
    except UnidentifiedImageError:
        raise UserError(f"{where}: image {name} is not an image in a supported format ({', '.join(SUPPORTED_FORMATS)}"
                        "), or it is corrupt") from None
    except OSError as e:
        raise UserError(f"{where}: image {name} is corrupt ({e})") from None
    return image.convert("RGB")


# -- markers in the prompt ----------------------------------------------------------------------------------------
def _content_text(content: Any) -> Any:
    """A message content list ([{"type": "image"}, {"type": "text", "text": ...}]) as text with `<image>` markers;
    anything else unchanged."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        parts.append(IMAGE_MARK if kind == "image" else str(part.get("text", "")) if kind == "text" else str(part))
    return "".join(parts)


def _count_marks(value: Any) -> int:
    if isinstance(value, str):
        return value.count(IMAGE_MARK)
    return sum(str(m.get("content", "")).count(IMAGE_MARK) for m in value if isinstance(m, dict))


def mark_images(value: Any, n_images: int, placeholder: str, where: str, flag: str) -> Any:
    """The prompt `value` (text or messages) with its `<image>` markers turned into `placeholder`; with no marker, the
    `n_images` markers go to the start of the text (or of the first user message). A marker count other than
    `n_images` is a UserError."""
    if isinstance(value, list):
        value = [dict(m, content=_content_text(m.get("content"))) if isinstance(m, dict) else m for m in value]
    marks = _count_marks(value)
    if marks == 0 and n_images:
        if isinstance(value, str):
            value = IMAGE_MARK * n_images + value
        else:
            first = next((i for i, m in enumerate(value) if isinstance(m, dict) and m.get("role") == "user"), None)
            if first is None:
                raise UserError(f"{where}: {flag} has no user message to put the record's images in")
            value[first] = dict(value[first], content=IMAGE_MARK * n_images + str(value[first].get("content", "")))
        marks = n_images
    if marks != n_images:
        raise UserError(f"{where}: {n_images} image(s) under --image_key but {marks} {IMAGE_MARK} placeholder(s) in "
                        f"{flag}; give one placeholder per image (or none, to put them all first)")
    if isinstance(value, str):
        return value.replace(IMAGE_MARK, placeholder)
    return [dict(m, content=str(m.get("content", "")).replace(IMAGE_MARK, placeholder)) if isinstance(m, dict)
            else m for m in value]


def expand_image_tokens(ids: Sequence[int], mask: Sequence[int], counts: Sequence[int], image_token_id: int,
                        where: str) -> tuple[list[int], list[int]]:
    """Repeat the i-th image-pad token of `ids` `counts[i]` times (its vision tokens; never loss targets)."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise UserError(f"{where}: {len(counts)} image(s) but {found} image placeholder(s) after the chat template; "
                        "the template dropped or repeated one")
    out_ids: list[int] = []
    out_mask: list[int] = []
    images = iter(counts)
    for t, m in zip(ids, mask):
        repeat = next(images) if t == image_token_id else 1
        out_ids.extend([t] * repeat)
        out_mask.extend([0 if t == image_token_id else m] * repeat)
    return out_ids, out_mask


# -- one record's images ------------------------------------------------------------------------------------------
class RecordImages:
    """Reads a record's images (`--image_key`, at most `--max_images_per_prompt`), marks them in its prompt and
    turns them into the model's pixel tensors with `processor` (the model's image processor)."""

    def __init__(self, tokens: VisionTokens, processor: Any, image_key: str, max_images: int):
        self.tokens = tokens
        self.processor = processor
        self.image_key = image_key
        self.max_images = max_images

    def read(self, record: Any, where: str) -> list[Any]:
        """The record's decoded images ([] when the key is absent or empty)."""
        value = record.get(self.image_key) if isinstance(record, dict) else None
        values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) > self.max_images:
            raise UserError(f"{where}: {len(values)} images under --image_key '{self.image_key}', more than "
                            f"--max_images_per_prompt {self.max_images}")
        return [decode_image(v, where, getattr(record, "source", None)) for v in values]

    def references(self, record: Any) -> list[str]:
        """The record's images as `image_reference` gives them to reward functions (after `read` checked them)."""
        value = record.get(self.image_key) if isinstance(record, dict) else None
        values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        return [image_reference(v, getattr(record, "source", None)) for v in values]

    def marked(self, record: Any, key: str, n_images: int, where: str, flag: str) -> Any:
        """A copy of `record` whose `key` field has the images' placeholders (the record itself when it has no
        images and no `<image>` marker)."""
        if not isinstance(record, dict) or key not in record:
            if n_images:
                raise UserError(f"{where} has images but no {flag} '{key}' to put them in")
            return record
        out = copy.copy(record)  # a Record keeps its source and index
        out[key] = mark_images(record[key], n_images, self.tokens.placeholder, where, flag)
        return out

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """{"pixel_values", "image_grid_thw"} of the images, decoded and processed once."""
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def token_counts(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        """Vision tokens of each image: its patches over merge_size**2."""
        return [int(n) for n in pixels["image_grid_thw"].prod(-1) // self.tokens.merge_size ** 2]

    def expand(self, ids: Sequence[int], mask: Sequence[int], pixels: dict[str, torch.Tensor],
               where: str) -> tuple[list[int], list[int]]:
        return expand_image_tokens(ids, mask, self.token_counts(pixels), self.tokens.image_token_id, where)
