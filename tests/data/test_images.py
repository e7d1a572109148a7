"""Images of vision-language records (rlhfkit/data/images.py): every accepted form decodes to the same pixels, a
bad image is one UserError naming the record, placeholders are counted and expanded to vision tokens by hand."""

from __future__ import annotations

import base64

import pytest
import torch
from PIL import Image

from rlhfkit.data.collate import pad_collate, pair_collate, with_pixels
from rlhfkit.data.images import (
    RecordImages,
    VisionTokens,
    decode_image,
    expand_image_tokens,
    image_reference,
    mark_images,
)
from rlhfkit.data.readers import Record
from rlhfkit.errors import UserError

WHERE = "data.jsonl: record 3"
PLACEHOLDER = "<vs><img><ve>"


def png(tmp_path, name="a.png", colour=(200, 10, 10), fmt="PNG"):
    path = tmp_path / name
    Image.new("RGB", (28, 28), colour).save(path, format=fmt)
    return path


def test_every_accepted_form_decodes_to_the_same_pixels(tmp_path):
    path = png(tmp_path)
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    forms = [str(path), f"file://{path}", f"data:image/png;base64,{b64}", b64, raw,
             {"bytes": raw, "path": None}, {"bytes": None, "path": str(path)}]
    expected = list(Image.open(path).convert("RGB").getdata())
    for form in forms:
        assert list(decode_image(form, WHERE).getdata()) == expected
    # relative paths: next to the data file when not under the working directory
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    assert decode_image("a.png", WHERE, source=str(data)).size == (28, 28)


def test_reward_functions_get_each_image_as_a_path_or_base64_text(tmp_path, monkeypatch):
    """A local file becomes its absolute path (a reward worker may run elsewhere), inline bytes base64 text that
    decodes to the same image, a data URL or base64 text stays as given."""
    path = png(tmp_path)
    raw = path.read_bytes()
    b64 = base64.b64encode(raw).decode()
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    monkeypatch.chdir(tmp_path.parent)
    assert image_reference("a.png", source=str(data)) == str(path.resolve())
    assert image_reference(f"file://{path}") == str(path.resolve())
    assert image_reference({"bytes": None, "path": str(path)}) == str(path.resolve())
    assert image_reference(raw) == b64 == image_reference({"bytes": raw, "path": None})
    assert image_reference(f"data:image/png;base64,{b64}") == f"data:image/png;base64,{b64}"
    assert image_reference(b64) == b64


@pytest.mark.parametrize("make, expect", [
    (lambda t: str(t / "missing.png"), "does not exist"),
    (lambda t: (t / "bad.png").write_bytes(b"not an image at all") and str(t / "bad.png"), "or it is corrupt"),
    (lambda t: str(png(t, "a.ppm", fmt="PPM")), "unsupported format PPM"),
    (lambda t: "https://example.com/a.png", "web URL"),
    (lambda t: 7, "give a path"),
])
def test_a_bad_image_is_one_error_naming_the_record(tmp_path, make, expect):
    with pytest.raises(UserError) as e:
        decode_image(make(tmp_path), WHERE)
    assert str(e.value).startswith(WHERE) and expect in str(e.value) and "\n" not in str(e.value)


def test_markers_become_placeholders_and_images_default_to_the_first_user_turn():
    assert mark_images("What?", 2, PLACEHOLDER, WHERE, "--input_key") == PLACEHOLDER * 2 + "What?"
    assert mark_images("a <image> b", 1, PLACEHOLDER, WHERE, "--input_key") == f"a {PLACEHOLDER} b"
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    out = mark_images(messages, 1, PLACEHOLDER, WHERE, "--input_key")
    assert out[1]["content"] == f"Look: {PLACEHOLDER}" and out[0]["content"] == "s"
    plain = mark_images([{"role": "user", "content": "hi"}], 1, PLACEHOLDER, WHERE, "--input_key")
    assert plain[0]["content"] == PLACEHOLDER + "hi"


def test_more_images_than_placeholders_is_refused():
    with pytest.raises(UserError, match=r"^data.jsonl: record 3: 2 image\(s\) .* but 1 <image> placeholder"):
        mark_images("one <image> only", 2, PLACEHOLDER, WHERE, "--input_key")


def test_expansion_repeats_each_pad_token_for_its_vision_tokens_with_no_loss_on_them():
    ids, mask = expand_image_tokens([1, 9, 5, 9, 6], [0, 1, 1, 1, 1], [2, 3], image_token_id=9, where=WHERE)
    assert ids == [1, 9, 9, 5, 9, 9, 9, 6]
    assert mask == [0, 0, 0, 1, 0, 0, 0, 1]
    with pytest.raises(UserError, match="2 image"):
        expand_image_tokens([1, 9], [0, 0], [2, 3], image_token_id=9, where=WHERE)


class FakeProcessor:
    """Two patches per image, each the image's mean colour: enough to check the layout."""

    def __call__(self, images, return_tensors):
        rows = [torch.tensor(im.getpixel((0, 0)), dtype=torch.float32).repeat(2, 1) for im in images]
        return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor([[1, 1, 2]] * len(images))}


def test_record_images_read_at_most_max_images_and_keep_the_record_source(tmp_path):
    reader = RecordImages(VisionTokens(9, PLACEHOLDER, 1), FakeProcessor(), "images", max_images=1)
    record = Record({"q": "Q", "images": [str(png(tmp_path)), str(png(tmp_path, "b.png"))]}, "d.jsonl", 2)
    with pytest.raises(UserError, match=r"^d.jsonl: record 3: 2 images .* more than --max_images_per_prompt 1"):
        reader.read(record, "d.jsonl: record 3")
    record["images"] = str(png(tmp_path))
    images = reader.read(record, WHERE)
    marked = reader.marked(record, "q", len(images), WHERE, "--input_key")
    assert marked["q"] == PLACEHOLDER + "Q" and marked.source == "d.jsonl" and record["q"] == "Q"
    assert reader.token_counts(reader.pixels(images)) == [2]


def test_collate_concatenates_images_in_row_order_and_pairs_repeat_them():
    def sample(colour):
        return {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([0, 1]),
                "pixel_values": torch.full((2, 3), float(colour)), "image_grid_thw": torch.tensor([[1, 1, 2]])}

    rows = [sample(1), {"input_ids": torch.tensor([3]), "loss_mask": torch.tensor([0])}, sample(2)]
    batch = with_pixels(pad_collate(rows, 0), rows)
    assert batch["pixel_values"][:, 0].tolist() == [1, 1, 2, 2] and batch["image_grid_thw"].shape == (2, 3)
    pair = {"prompt_ids": torch.tensor([1]), "chosen_ids": torch.tensor([2]), "rejected_ids": torch.tensor([3]),
            "pixel_values": torch.full((2, 3), 5.0), "image_grid_thw": torch.tensor([[1, 1, 2]])}
    assert pair_collate([pair], 0)["pixel_values"].shape == (4, 3)  # the chosen row's image, then the rejected's
