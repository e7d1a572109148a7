"""The loop skeleton (`rlhfkit/run/loop.py`) with a scripted trainer, no model: the cadence an offline and an RL
trainer get from it (logging, samples, evaluation per pass or every N steps, a step cap, the best metric), and its
one save/resume pair (state.json as the trainers wrote it before, the trainer's extra state, the same data order)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlhfkit.config.common import CheckpointArgs, LoggingArgs
from rlhfkit.errors import UserError
from rlhfkit.run.loop import LoopSettings, LoopState, Trainer, TrainingLoop
from rlhfkit.run.runs import RunInfo

NUM_ITEMS, BATCH = 12, 4  # three batches a pass


class Recorder:
    """A MetricsLogger stand-in: what was logged, in order."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, int, dict[str, Any]]] = []

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        self.lines.append((prefix, step, dict(metrics)))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.lines.append(("samples", step, {"rows": len(rows)}))

    def resumed_at(self, step: int) -> None:
        self.lines.append(("resumed", step, {}))

    def steps(self, prefix: str) -> list[int]:
        return [step for kind, step, _ in self.lines if kind == prefix]


class Scripted(Trainer):
    """One step = one global batch of item indices; eval returns a score that rises then falls; a KL-like
    coefficient stands for the trainer's own resumable state."""

    def __init__(self, logger: Recorder, scores: list[float] | None = None):
        self.logger = logger
        self.batches: list[list[int]] = []
        self.kl_coef = 0.5
        self.scores = list(scores or [])
        self.best_exports: list[str] = []
        self.model = Target()

    def steps_per_epoch(self) -> int:
        return NUM_ITEMS // BATCH

    def next_work(self, state: LoopState) -> list[int] | None:
        return state.next_batch(NUM_ITEMS, BATCH, seed=7, max_epochs=2)

    def step(self, work: list[int], state: LoopState) -> dict[str, float]:
        self.batches.append(list(work))
        self.kl_coef *= 0.9
        self.model.weight += 1
        return {"loss": float(state.global_step), "epoch": state.epoch}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["loss"]}

    def evaluate(self, step: int) -> dict[str, float] | None:
        metrics = {"score": self.scores.pop(0) if self.scores else 0.0}
        self.logger.log(step, metrics, prefix="eval")
        return metrics

    def checkpoint_targets(self) -> dict[str, Any]:
        return {"model": self.model}

    def report_rows(self) -> list[dict[str, Any]]:
        return [{"prompt": "p", "response": "r", "reward": 1.0}]

    def save_best(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.best_exports.append(path)

    def extra_state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        self.kl_coef = saved["kl_coef"]


class Target:
    """A checkpoint target that saves itself, as RL roles do."""

    def __init__(self) -> None:
        self.weight = 0

    def save_checkpoint(self, directory: str, tag: str, save_latest: bool = False) -> None:
        Path(directory, tag).mkdir(parents=True)
        Path(directory, tag, "weight.json").write_text(json.dumps(self.weight))

    def load_checkpoint(self, directory: str, tag: str) -> tuple[Any, ...]:
        self.weight = json.loads(Path(directory, tag, "weight.json").read_text())
        return (directory,)


STRATEGY = SimpleNamespace(is_rank0=True, rank=0, world_size=1, barrier=lambda: None, print=lambda *a: None)


def make_loop(tmp_path: Path, trainer: Scripted, *, eval_steps: int = -1, save_steps: int = -1,
              max_steps: int = -1, resume: bool = False, **settings: Any) -> TrainingLoop:
    logging = LoggingArgs(eval_steps=eval_steps, disable_progress_bar=True)
    ckpt = CheckpointArgs(save_path=str(tmp_path / "save"), ckpt_path=str(tmp_path / "ckpt"), save_steps=save_steps,
                          load_checkpoint=resume)
    loop_settings = LoopSettings(name="test", max_epochs=2, max_steps=max_steps, logging=logging, checkpoint=ckpt,
                                 **settings)
    return TrainingLoop(trainer, loop_settings, STRATEGY, trainer.logger, RunInfo("test"))  # type: ignore[arg-type]


def test_offline_cadence_evaluates_at_each_pass_end_and_a_step_cap_ends_without_one(tmp_path):
    log = Recorder()
    trainer = Scripted(log)
    history = make_loop(tmp_path, trainer).fit()
    assert len(history) == 6 and log.steps("train") == [1, 2, 3, 4, 5, 6]
    assert log.steps("eval") == [3, 6]  # --eval_steps -1: the end of each pass
    assert [h["epoch"] for h in history] == [0, 0, 0, 1, 1, 1]
    assert sorted(i for b in trainer.batches[:3] for i in b) == list(range(NUM_ITEMS))  # each item once a pass
    assert trainer.batches[:3] != trainer.batches[3:]  # reshuffled for the second pass

    log = Recorder()
    make_loop(tmp_path, Scripted(log), max_steps=4).fit()
    assert log.steps("train") == [1, 2, 3, 4] and log.steps("eval") == [3]  # offline: no eval after a cap


def test_rl_cadence_samples_a_final_eval_after_a_step_cap_and_every_n_steps(tmp_path):
    log = Recorder()
    make_loop(tmp_path, Scripted(log), max_steps=5, eval_at_end=True).fit()
    assert log.steps("eval") == [3, 5]  # the end of the episode, and the end of the run inside one
    assert log.steps("samples") == [1, 2, 3, 4, 5]  # step 1, the last, every total // 5
    log = Recorder()
    make_loop(tmp_path / "b", Scripted(log), eval_steps=2, eval_at_end=True).fit()
    assert log.steps("eval") == [2, 4, 6]  # every N steps; the last step was evaluated already


def test_best_metric_exports_on_improvement_only_and_names_a_missing_metric(tmp_path):
    trainer = Scripted(Recorder(), scores=[0.2, 0.5, 0.4, 0.9])
    loop = make_loop(tmp_path, trainer, eval_steps=1, max_steps=4, best_metric_key="eval/score")
    loop.fit()
    best = tmp_path / "save" / "best"
    assert trainer.best_exports == [str(best)] * 3  # 0.2, 0.5, 0.9; not 0.4
    assert json.loads((best / "best_metric.json").read_text()) == {"metric": "eval/score", "value": 0.9, "step": 4}
    assert loop.state.best_metric == 0.9
    with pytest.raises(UserError, match="--best_metric_key eval/pass@1: evaluation logs no such metric; it logs "
                                        "eval/score"):
        make_loop(tmp_path / "b", Scripted(Recorder()), eval_steps=1, best_metric_key="eval/pass@1").fit()


@pytest.mark.parametrize("pass_name", ["epoch", "episode"])
def test_resume_continues_the_same_data_order_with_the_trainers_state(tmp_path, pass_name):
    """A run checkpointed every 2 steps and stopped after 4 resumes at step 4 and trains the same batches as an
    uninterrupted run; state.json has the keys the offline (epoch) and RL (episode) trainers always wrote."""
    whole = Scripted(Recorder())
    make_loop(tmp_path / "whole", whole, pass_name=pass_name).fit()

    first = Scripted(Recorder())
    make_loop(tmp_path, first, save_steps=2, max_steps=4, pass_name=pass_name).fit()
    saved = json.loads((tmp_path / "ckpt" / "global_step4" / "state.json").read_text())
    assert saved == {pass_name: 1, f"batch_in_{pass_name}": 1, "kl_coef": pytest.approx(0.5 * 0.9 ** 4),
                     "global_step": 4}
    second = Scripted(Recorder())
    loop = make_loop(tmp_path, second, save_steps=2, resume=True, pass_name=pass_name)
    loop.fit()
    assert first.batches + second.batches == whole.batches
    assert second.model.weight == whole.model.weight and second.kl_coef == pytest.approx(whole.kl_coef)
    assert loop.state == LoopState(global_step=6, epoch=1, batch_in_epoch=3)


def test_a_checkpoint_at_a_pass_end_resumes_into_the_next_pass_without_evaluating_again(tmp_path):
    make_loop(tmp_path, Scripted(Recorder()), save_steps=3, max_steps=3).fit()
    log = Recorder()
    make_loop(tmp_path, Scripted(log), save_steps=3, resume=True).fit()
    assert log.steps("train") == [4, 5, 6] and log.steps("eval") == [6]
