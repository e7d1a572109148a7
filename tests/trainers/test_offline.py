"""The offline trainers' shared step (`rlhfkit/trainers/offline.py`) under a diverging run: non-finite updates are
skipped and counted in the metrics, and too many in a row stop the run cleanly with its checkpoints intact; and the
evaluation shards over ranks."""

from __future__ import annotations

import torch


def test_nonfinite_sft_run_skips_counts_and_stops_with_its_checkpoints_intact(demo_assets, tmp_path, capsys):
    """A learning rate of 1e30 makes the weights overflow after the first update, so every later loss is NaN:
    train_sft skips those updates (counted as nonfinite_skipped), stops after --max_nonfinite_steps in a row with
    one line and exit code 2, and the checkpoints it wrote stay loadable with finite weights."""
    import json

    from tests.helpers import run_here

    save, ckpt = tmp_path / "save", tmp_path / "ckpt"
    proc = run_here(["rlhfkit.cli.train_sft", "--pretrain", str(demo_assets.model_dir), "--dataset",
                     str(demo_assets.sft_train), "--input_key", "question", "--output_key", "response",
                     "--input_template", "User: {}\nAssistant: ", "--max_len", "48", "--max_samples", "64",
                     "--train_batch_size", "4", "--micro_train_batch_size", "2", "--learning_rate", "1e30",
                     "--lr_scheduler", "constant", "--max_nonfinite_steps", "2", "--save_steps", "1",
                     "--save_path", str(save), "--ckpt_path", str(ckpt), "--disable_progress_bar"], capsys)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len([line for line in err if "error" in line]) == 1, proc.stderr
    assert "2 optimizer steps in a row had a non-finite loss or gradient" in err[-1], err[-1]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    # step 1 trained (weights now overflow), step 2 skipped, step 3 skipped too: the run stops before logging it
    assert [r["train/nonfinite_skipped"] for r in rows] == [0, 1], rows
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    # the skipped step-2 update left the checkpointed weights exactly as step 1 wrote them
    step1, step2 = (torch.load(ckpt / f"global_step{i}" / "model" / "mp_rank_00_model_states.pt",
                               map_location="cpu", weights_only=False)["module"] for i in (1, 2))
    assert step1.keys() == step2.keys() and all(torch.equal(step1[k], step2[k]) for k in step1)


def test_eval_shards_run_the_same_number_of_forwards_on_every_rank():
    """Evaluation over ranks (SFT, RM, DPO, KTO): 5 samples, micro batches of 2, 2 ranks. Rank 0 holds samples 0, 2,
    4 (two batches), rank 1 holds 1, 3 (one batch) and pads with a batch marked not real, since a ZeRO-3 forward is
    a collective; the real batches cover every sample exactly once."""
    from types import SimpleNamespace

    from rlhfkit.trainers.offline import OfflineTrainer

    def shards(rank: int, n: int = 5, world: int = 2, limit: int | None = None) -> list[tuple[list[int], bool]]:
        loop = OfflineTrainer.__new__(OfflineTrainer)
        loop.strategy = SimpleNamespace(dp_rank=rank, dp_world_size=world)  # data-parallel: no sequence groups
        loop.args = SimpleNamespace(micro_train_batch_size=2)
        loop.collate = list
        return list(loop.sharded_batches(list(range(n)), limit))

    assert shards(0) == [([0, 2], True), ([4], True)]
    assert shards(1) == [([1, 3], True), ([0], False)]
    for n, world in ((1, 2), (7, 3), (8, 2), (3, 4)):
        per_rank = [shards(r, n, world) for r in range(world)]
        assert len({len(s) for s in per_rank}) == 1, (n, world)
        real = sorted(i for s in per_rank for batch, is_real in s if is_real for i in batch)
        assert real == list(range(n)), (n, world)
    assert [b for r in range(2) for b, real in shards(r, limit=3) if real] == [[0, 2], [1]]
