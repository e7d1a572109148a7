"""Atomic final saves: the model moves into the run directory config.json last, old shards do not linger, the run's
other files stay."""

from __future__ import annotations

import os

from rlhfkit.models import publish
from rlhfkit.models.publish import publish_model_dir, staging_dir


def test_config_json_leaves_first_and_arrives_last(tmp_path, monkeypatch):
    target = tmp_path / "run"
    target.mkdir()
    for name, text in {"config.json": "old", "model-00001-of-00002.safetensors": "a",
                       "model.safetensors.index.json": "i", "metrics.jsonl": "m"}.items():
        (target / name).write_text(text)
    staging = staging_dir(str(target))
    assert staging.parent == tmp_path and staging.name == ".run.saving" and not any(staging.iterdir())
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (staging / name).write_text("new " + name)
    seen = []
    real_replace = os.replace

    def recording(src, dst):  # what the directory looks like just before each move (where a kill could land)
        seen.append((os.path.basename(dst), (target / "config.json").exists()))
        real_replace(src, dst)

    monkeypatch.setattr(publish.os, "replace", recording)
    publish_model_dir(staging, str(target))
    assert seen == [("model.safetensors", False), ("tokenizer.json", False), ("config.json", False)]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "metrics.jsonl", "model.safetensors",
                                                        "tokenizer.json"]
    assert (target / "config.json").read_text() == "new config.json"
    assert (target / "metrics.jsonl").read_text() == "m"
    assert not staging.exists()
