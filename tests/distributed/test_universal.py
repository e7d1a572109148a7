"""The universal checkpoint's parts, in a world of one: a save from each engine layout loads into the next with the
fp32 master weights, both Adam moments, the model's own (bf16) weights, the optimizer step and the learning rate
exactly as they were. The chain visits every place a part lives: ZeRO-2 bf16 (DeepSpeed's fragments), ZeRO-3 (its
partitions), bf16 at ZeRO-0 (DeepSpeed's unfused optimizer and its fp32 master copies: the save that raised
KeyError: 'exp_avg'), fp32 at ZeRO-0 (the plain-torch engine: the parameters themselves). The state is read back
with DeepSpeed's full-tensor API, not with the code under test. Resharding across world sizes runs through the CLI
in tests/run/test_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.distributed.universal import (
    ADAM_STATES,
    SHARD_FILE,
    _link_fragments,
    load_universal_state,
    save_universal_state,
)
from tests.distributed.test_plain_torch_engine import ACCUM, MICRO, batches, tiny_llama, train

LAYOUTS = [(2, True), (3, False), (0, True), (0, False), (2, True)]  # (ZeRO stage, bf16)


def engine_of(stage: int, bf16: bool, seed: int):
    args = StrategyArgs(zero_stage=stage, train_batch_size=MICRO * ACCUM, micro_train_batch_size=MICRO,
                        learning_rate=1e-2, lr_warmup_ratio=0.5, max_norm=1.0, l2=0.1)
    strategy = DeepSpeedStrategy(args, bf16=bf16)
    strategy.setup_distributed()
    return strategy.prepare_train(tiny_llama(seed), 1e-2, 4)


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """name -> fp32 master weight and Adam moments, whole: DeepSpeed's safe_get_full_* (ZeRO 1-3), else the
    optimizer's own tensors (its fp32 master copy of a bf16 parameter, or the parameter)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    masters = {id(lo): hi for low, high in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
               for lo, hi in zip(low, high)}
    inner = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
    _link_fragments(engine)  # DeepSpeed 0.19 links the second param group's fragments late (see universal.py)
    state = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is not None:
            state[name] = {"fp32": full, **{k: safe_get_full_optimizer_state(p, k) for k in ADAM_STATES}}
        else:
            master = masters.get(id(p), p)
            state[name] = {"fp32": master, **{k: inner.state[master][k] for k in ADAM_STATES}}
        state[name] = {k: v.detach().float().clone().view(-1) for k, v in state[name].items()}
    return state


def model_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if hasattr(params[0], "ds_id") else torch.no_grad():
        return {n: p.detach().clone().view(-1) for n, p in engine.module.named_parameters()}


def test_each_layout_loads_the_previous_ones_save_exactly(world_of_one, tmp_path: Path):
    engine = engine_of(*LAYOUTS[0], seed=0)
    train(engine, batches(ACCUM))
    expected, lr = full_state(engine), engine.get_lr()[0]
    assert all(s["exp_avg"].abs().sum() > 0 for s in expected.values())  # it trained: the moments are not zeros
    for i, (stage, bf16) in enumerate(LAYOUTS[1:]):
        save_universal_state(engine, tmp_path / str(i))
        assert (tmp_path / str(i) / SHARD_FILE.format(rank=0)).is_file()
        engine = engine_of(stage, bf16, seed=i + 1)
        load_universal_state(engine, tmp_path / str(i))
        got = full_state(engine)
        for name, parts in expected.items():
            for key, value in parts.items():
                assert torch.equal(got[name][key], value), (stage, bf16, name, key)
        dtype = torch.bfloat16 if bf16 else torch.float32
        for name, w in model_weights(engine).items():
            assert torch.equal(w, expected[name]["fp32"].to(dtype)), (stage, bf16, name)
        assert engine.get_lr()[0] == lr and engine.global_steps == 1, (stage, bf16)


def test_the_single_file_form_of_earlier_versions_still_loads(world_of_one, tmp_path: Path):
    """Before sharding, rank 0 wrote every weight and moment whole into universal_state.pt; such a checkpoint still
    resumes (here into the plain-torch engine)."""
    from rlhfkit.distributed.universal import UNIVERSAL_FILE

    engine = engine_of(0, False, seed=0)
    train(engine, batches(ACCUM))
    state = full_state(engine)
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}
    legacy = {"params": {n: s["fp32"].view(shapes[n]) for n, s in state.items()},
              **{k: {n: s[k].view(shapes[n]) for n, s in state.items()} for k in ADAM_STATES},
              "step": 1.0, "scheduler": engine.lr_scheduler.state_dict(), "counters": {"global_steps": 1}}
    torch.save(legacy, tmp_path / UNIVERSAL_FILE)
    resumed = engine_of(0, False, seed=1)
    load_universal_state(resumed, tmp_path)
    got = full_state(resumed)
    assert all(torch.equal(got[n][k], v) for n, parts in state.items() for k, v in parts.items())
    assert resumed.global_steps == 1 and resumed.get_lr() == engine.get_lr()
