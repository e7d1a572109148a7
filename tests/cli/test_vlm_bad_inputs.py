"""Bad vision-language input stops with one line naming the record and exit code 2, before any model loads or any
process group is joined (train_sft's main in-process, as tests/cli/test_bad_inputs.py runs the other cases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tests.cli.test_bad_inputs import assert_one_line_error, call_in_process


@pytest.fixture
def clean_group():
    """Start and end each case without a process group (each must fail before joining one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


def data(tmp: Path, images: object, prompt: str = "What is it?") -> str:
    path = tmp / "data.jsonl"
    good = {"prompt": prompt, "answer": "red", "images": [str(png(tmp / "ok.png"))]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, images=images)) + "\n")
    return str(path)


def png(path: Path, fmt: str = "PNG") -> Path:
    Image.new("RGB", (56, 56), (200, 0, 0)).save(path, format=fmt)
    return path


def text_only_model(vlm_assets, tmp: Path) -> str:
    """A text-only model directory: a Llama config (no weights are read before the check) and the tokenizer."""
    from transformers import LlamaConfig

    out = tmp / "llama"
    LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(vlm_assets.model_dir / name, out / name)
    return str(out)


CASES = {
    "missing_file": (lambda a, t: ["--dataset", data(t, ["gone.png"])], ("record 2", "gone.png", "does not exist")),
    "corrupt_file": (lambda a, t: ["--dataset", data(t, [str(t / "bad.png")])], ("record 2", "corrupt")),
    "unsupported_format": (lambda a, t: ["--dataset", data(t, [str(png(t / "x.ppm", "PPM"))])],
                           ("record 2", "unsupported format PPM")),
    "more_than_placeholders": (lambda a, t: ["--dataset", data(t, [str(png(t / "a.png"))] * 2, "one <image>"),
                                             "--max_images_per_prompt", "2"],
                               ("record 2", "2 image(s)", "1 <image> placeholder")),
    "more_than_max_images": (lambda a, t: ["--dataset", data(t, [str(png(t / "a.png"))] * 2)],
                             ("record 2", "2 images", "--max_images_per_prompt 1")),
    "text_only_model": (lambda a, t: ["--dataset", data(t, []), "--pretrain", text_only_model(a, t)],
                        ("--image_key needs a vision-language model", "text-only llama")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_image_input_is_one_line_exit_2(case, vlm_assets, tmp_path, capsys, clean_group):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n but then nothing")
    argv_of, expect = CASES[case]
    argv = ["--pretrain", str(vlm_assets.model_dir), "--input_key", "prompt", "--output_key", "answer",
            "--data.image_key", "images", "--apply_chat_template", "--save_path", str(tmp_path / "save"),
            "--train_batch_size", "1", "--micro_train_batch_size", "1", *argv_of(vlm_assets, tmp_path)]
    code, err = call_in_process("train_sft", argv, capsys)
    assert_one_line_error(code, err, expect)
    assert not clean_group.is_initialized()


def test_commands_without_images_refuse_the_openrlhf_image_flags(capsys):
    code, err = call_in_process("serve_rm", ["--data.image_key", "images"], capsys)
    assert_one_line_error(code, err, ("--data.image_key", "this command does not take images"))


def test_max_images_without_an_image_key_is_refused(capsys):
    code, err = call_in_process("train_dpo", ["--dataset", "d.jsonl", "--max_images_per_prompt", "2"], capsys)
    assert_one_line_error(code, err, ("--max_images_per_prompt", "add --image_key"))


def test_sequence_parallelism_with_images_is_refused(vlm_assets, tmp_path, capsys):
    code, err = call_in_process("train_sft", ["--pretrain", str(vlm_assets.model_dir), "--dataset", "d.jsonl",
                                              "--image_key", "images", "--ring_attn_size", "2"], capsys)
    assert_one_line_error(code, err, ("--ring_attn_size 2 with --image_key is not supported yet",))


def test_a_distillation_teacher_that_would_not_see_the_images_is_refused(capsys):
    code, err = call_in_process("train_ppo", ["--data.image_key", "images", "--teacher_pretrain", "t"], capsys)
    assert_one_line_error(code, err, ("--teacher_pretrain / --teacher_url with --image_key is not supported yet",))
