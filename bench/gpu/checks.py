"""The GPU suite's correctness checks (bench/gpu/suite.py runs them in one child, after the device's matmul peak):
bf16 training tracks fp32, and the Transformers rollout engine's sampled log-probs match the trainer's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import common
import flops


def check_bf16_vs_fp32(model: Path, steps: int) -> dict:
    import torch

    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from rlhfkit.models.loading import load_causal_lm

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 200, (4, 32), generator=g) for _ in range(steps)]
    losses = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        args = StrategyArgs(zero_stage=0 if not bf16 else 2, train_batch_size=4, micro_train_batch_size=4,
                            learning_rate=1e-4, lr_warmup_ratio=0.0)
        strategy = DeepSpeedStrategy(args, bf16=bf16)
        strategy.setup_distributed()
        engine = strategy.prepare_train(load_causal_lm(str(model), dtype=torch.float32), 1e-4, steps)
        losses[name] = []
        for ids in batches:
            ids = ids.to(strategy.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses[name].append(float(loss))
        del engine
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["fp32"], losses["bf16"]))
    return {"passed": worst < 0.05, "max_rel_diff": worst, **losses}


def check_engine_logprobs(model: Path, bf16: bool) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.rl.experience import experience_from_samples
    from rlhfkit.rl.role_forward import action_log_probs
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    lm = load_causal_lm(str(model), dtype=torch.bfloat16 if bf16 else torch.float32)
    engine = HFRolloutEngine(lm, tok, device=device)
    prompts = [[tok.bos_token_id] + tok(f"What is {i}+{i * 3}?").input_ids for i in range(8)]
    samples = engine.generate(prompts, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    exp = experience_from_samples(samples, tok.pad_token_id)
    with torch.no_grad():
        trainer = action_log_probs(engine.model, exp.to(device), 1.0).float().cpu()
    mask = exp.action_mask.bool()
    diff = (trainer - exp.rollout_log_probs)[mask].abs()
    worst, mean = float(diff.max()), float(diff.mean())
    passed = worst < 1e-4 if not bf16 else (worst < 0.1 and mean < 0.02)
    return {"passed": passed, "max_abs_diff": worst, "mean_abs_diff": mean, "tokens": int(mask.sum())}


def child_checks(sizes: Any, model: Path) -> None:
    """The peak and both checks in this process; one result line after each (a later failure keeps the earlier)."""
    import traceback

    result: dict = {}
    steps = (("peak", lambda: flops.matmul_peak()), ("bf16_vs_fp32", lambda: check_bf16_vs_fp32(model, 3)),
             ("engine_logprobs", lambda: check_engine_logprobs(model, sizes.bf16)))
    for name, run in steps:
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 -- recorded and reported; the next check still runs
            traceback.print_exc()
            result[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(common.MARK + json.dumps(result), flush=True)
