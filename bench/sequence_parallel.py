"""What sequence parallelism costs: one SFT forward+backward of a long packed row on 1 rank, and split over 2 gloo ranks
with `--ring_attn_size 2`'s code path (`rlhfkit.models.sequence_parallel`), same model, same row.

    python bench/sequence_parallel.py [--tokens 2048] [--reps 5]

Prints one markdown table row per layout: median seconds per forward+backward (rank 0's, after one warm-up), the
ratio to 1 rank, and each process's peak RSS. One torch thread per process, so 2 ranks use 2 cores where 1 rank uses
one: the ratio is the wall time a user sees, not the work done. Results: bench/results/sequence_parallel.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import peak_rss_mb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_and_row(tokens: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.data.packing import pack_collate

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=tokens,
                         attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(4096, (tokens // 4,), generator=generator),
                "loss_mask": torch.ones(tokens // 4, dtype=torch.long)} for _ in range(4)]
    return LlamaForCausalLM(config), pack_collate(samples)


def time_steps(tokens: int, reps: int) -> list[float]:
    from rlhfkit.algorithms.sft_loss import sft_loss
    from rlhfkit.models.policy import forward_logits
    from rlhfkit.models.sequence_parallel import sequence_parallel_logprobs, sequence_parallel_size

    model, row = model_and_row(tokens)
    targets = int(row["loss_mask"][:, 1:].sum())
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        if sequence_parallel_size() > 1:
            loss = -sequence_parallel_logprobs(model, row)[0].sum() / targets
        else:
            loss = sft_loss(forward_logits(model, row), row["input_ids"], row["loss_mask"],
                            sample_ids=row["sample_ids"], num_tokens=targets)
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[1:]


def _rank(rank: int, world: int, port: int, tokens: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    from rlhfkit.models.sequence_parallel import set_sequence_parallel_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    set_sequence_parallel_group(dist.group.WORLD)
    times = time_steps(tokens, reps)
    rss = peak_rss_mb()
    Path(f"{out}.{rank}").write_text(f"{statistics.median(times)} {rss}")
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    from rlhfkit.distributed.launch import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    a = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    one = statistics.median(time_steps(a.tokens, a.reps))
    one_rss = peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.start_processes(_rank, args=(2, free_port(), a.tokens, a.reps, out), nprocs=2, start_method="spawn")
        two, two_rss = (float(x) for x in Path(f"{out}.0").read_text().split())
        rss_1 = float(Path(f"{out}.1").read_text().split()[1])
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| layout | tokens per row | s per forward+backward (median) | ratio to 1 rank | peak RSS MB per process |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| 1 rank | {a.tokens} | {one:.3f} | 1.00 | {one_rss:.0f} |")
    print(f"| 2 ranks, --ring_attn_size 2 | {a.tokens} | {two:.3f} | {two / one:.2f} | {two_rss:.0f}, {rss_1:.0f} |")


if __name__ == "__main__":
    main()
