"""Image prompts from a parquet file (image bytes in a {"bytes", "path"} struct column, the form Hugging Face writes)
and from a directory written by `datasets`' save_to_disk with an Image feature load through `load_records` into
the same prompts, pixel tensors and vision-token counts as the JSONL file with image paths."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.prompt_dataset import PromptDataset
from rlhfkit.data.readers import load_records


@pytest.fixture(scope="module")
def reader(vlm_assets):
    from transformers import AutoConfig

    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.vision import record_images

    path = str(vlm_assets.model_dir)
    tokenizer = load_tokenizer(path)
    return tokenizer, record_images(AutoConfig.from_pretrained(path), path, tokenizer, "images", 1)


def prompts(records, reader) -> PromptDataset:
    tokenizer, images = reader
    return PromptDataset(records, tokenizer, input_key="prompt", label_key="answer", apply_chat_template=True,
                         images=images)


def test_parquet_and_a_saved_dataset_give_the_jsonl_images(vlm_assets, reader, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = vlm_assets.split("rl_train")
    rows = load_records(str(jsonl))[:3]
    files = [jsonl.parent / r["images"][0] for r in rows]
    table = {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
             "images": [[{"bytes": f.read_bytes(), "path": None}] for f in files]}
    pq.write_table(pa.table(table), tmp_path / "rl.parquet")
    saved = tmp_path / "saved"
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.Sequence(datasets.Image())})
    datasets.Dataset.from_dict({**table, "images": [[str(f)] for f in files]}, features=features).save_to_disk(saved)

    expected = prompts(rows, reader).samples
    for spec in (str(tmp_path / "rl.parquet"), str(saved)):
        got = prompts(load_records(spec), reader).samples
        assert [s["prompt"] for s in got] == [s["prompt"] for s in expected], spec
        for mine, theirs in zip(got, expected):
            assert torch.equal(mine["images"]["pixel_values"], theirs["images"]["pixel_values"]), spec
            assert torch.equal(mine["images"]["image_grid_thw"], theirs["images"]["image_grid_thw"]), spec
            assert len(mine["image_refs"]) == 1
