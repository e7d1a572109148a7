"""rlhfkit.algorithms.lr_schedule: every --lr_scheduler choice gives Transformers' learning rates step by step, by
hand at a few points, and the scheduler built by `make_scheduler` saves and resumes as Transformers' does."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_scheduler

from rlhfkit.algorithms.lr_schedule import SCHEDULES, lr_factor, schedule

CASES = [(0, 1), (0, 10), (3, 10), (10, 10), (1, 2), (30, 1000), (12, 7)]  # (warmup, total), odd ones included


def _lrs(make, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("warmup,total", CASES)
def test_each_schedule_matches_transformers_step_by_step(name: str, warmup: int, total: int) -> None:
    kwargs = {"min_lr_rate": 0.1} if name == "cosine_with_min_lr" else {}
    theirs = _lrs(lambda o: get_scheduler(name, o, num_warmup_steps=warmup, num_training_steps=total,
                                          scheduler_specific_kwargs=kwargs), total + 3)
    ours = _lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule(name, warmup, total, **kwargs)), total + 3)
    assert ours == pytest.approx(theirs, rel=0, abs=1e-15)


def test_hand_values() -> None:
    # warmup 4 of 12: 0, 1/4, 2/4, 3/4, then the decay over the 8 steps left
    assert [lr_factor(s, name="linear", warmup=4, total=12) for s in (0, 1, 3, 4, 8, 12, 13)] == \
        [0.0, 0.25, 0.75, 1.0, 0.5, 0.0, 0.0]
    assert lr_factor(8, name="cosine", warmup=4, total=12) == pytest.approx(0.5)  # half way: cos(pi/2)
    assert lr_factor(6, name="cosine", warmup=4, total=12) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    # the min-lr cosine ends at the floor and is floor + (1 - floor) x cosine between
    assert lr_factor(12, name="cosine_with_min_lr", warmup=4, total=12, min_lr_rate=0.1) == pytest.approx(0.1)
    assert lr_factor(8, name="cosine_with_min_lr", warmup=4, total=12, min_lr_rate=0.1) == pytest.approx(0.55)
    assert lr_factor(0, name="constant", warmup=4, total=12) == 1.0  # constant ignores the warmup
    assert lr_factor(2, name="constant_with_warmup", warmup=4, total=12) == 0.5


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'polynomial'"):
        schedule("polynomial", 1, 10)


def test_a_resumed_scheduler_continues_where_it_stopped() -> None:
    """LambdaLR state saved at step 5 and loaded into a fresh scheduler (as a checkpoint resume does) gives the
    uninterrupted run's learning rates."""
    def build():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule("cosine_with_min_lr", 2, 10, 0.1))

    opt, sched = build()
    straight = []
    for _ in range(10):
        straight.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    opt, sched = build()
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2, sched2 = build()
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    resumed = []
    for _ in range(5):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(straight[5:])
