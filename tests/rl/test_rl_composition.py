"""The RL stack's parts composed with fakes (no model, no Ray): the rollout source walks the prompt stream on the
loop's `LoopState`, samples with the step's seed and refills filtered groups from the next prompts; the trainer
calls the roles in the order of an RL step and syncs weights only when the actor trained."""

from __future__ import annotations

import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.data.sampler import global_batches
from rlhfkit.rl.rollout_source import ROUND_STRIDE, SEED_STRIDE, RolloutSource
from rlhfkit.rl.trainer import RLTrainer
from rlhfkit.rollout.engine import FINISH_STOP, SampledSequence
from rlhfkit.run.loop import LoopState

RESPONSE = [5, 6, 7]


def config(*extra: str) -> PPOConfig:
    return parse_config(PPOConfig, [
        "--pretrain", "tiny", "--prompt_data", "prompts", "--remote_rm_url", "reward.py", "--seed", "7",
        "--advantage_estimator", "group_norm", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--micro_rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--generate_max_len", "4", *extra], "test")


class Tokenizer:
    pad_token_id, eos_token_id, bos_token_id = 0, 0, None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 50 + 1 for c in text]

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return ["xyz" for _ in ids]


class Engine:
    """Every response is RESPONSE; records the seeds and the calls."""

    def __init__(self, calls: list[str]):
        self.calls, self.seeds = calls, []

    def generate(self, prompt_ids, *, max_new_tokens, seed=None, **sampling):
        self.seeds.append(seed)
        return [SampledSequence(list(p), list(RESPONSE), [-1.0] * len(RESPONSE), FINISH_STOP) for p in prompt_ids]

    def wake(self) -> None:
        self.calls.append("engine.wake")

    def sleep(self) -> None:
        self.calls.append("engine.sleep")


class Reward:
    """Prompt "p<i>": odd i scores 0 and 1 over its two samples (mean 0.5, kept by --dynamic_filtering 0 1), even
    i scores 0 and 0 (dropped)."""

    def score(self, batch):
        scores = [float(int(p[1:]) % 2 and j % 2) for j, p in enumerate(batch["prompts"])]
        return {"rewards": scores, "scores": scores}


def source(cfg: PPOConfig, n: int, calls: list[str] | None = None) -> RolloutSource:
    prompts = [{"prompt": f"p{i}", "label": None} for i in range(n)]
    return RolloutSource(cfg, Engine([] if calls is None else calls), Reward(), Tokenizer(), prompts)


def test_the_stream_is_the_seeded_batches_of_each_episode_on_the_loop_state():
    src, state = source(config("--num_episodes", "2"), 6), LoopState()
    drawn = []
    while (rollout := src.next_rollout(state)) is not None:
        drawn.append((state.epoch, state.batch_in_epoch, rollout.texts["prompts"]))
        state.global_step += 1
    expected = [(e, b + 1, [f"p{i}" for i in batch for _ in range(2)])
                for e in range(2) for b, batch in enumerate(global_batches(6, 2, 7, e))]
    assert drawn == expected
    assert src.engine.seeds == [7 * SEED_STRIDE + step for step in range(6)]  # each step's own sampling seed


def test_dynamic_filtering_refills_from_the_next_prompts_with_new_seeds():
    cfg = config("--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1")
    src, state = source(cfg, 8), LoopState(global_step=3)
    rollout = src.rollout(src.next_prompts(state), state)
    kept = rollout.texts["prompts"]
    assert len(kept) == 4 and all(int(p[1:]) % 2 for p in kept)
    rounds = int(rollout.recipe_metrics["dynamic_filtering/rounds"])
    assert state.batch_in_epoch == rounds  # one more batch of the stream per refill round
    base = 7 * SEED_STRIDE + 3
    assert src.engine.seeds == [base + r * ROUND_STRIDE for r in range(rounds)]


class Role:
    """A fake actor / reference: log-probs of zeros, a training call that reports a loss."""

    def __init__(self, name: str, calls: list[str]):
        self.name, self.calls = name, calls

    def log_probs(self, batch):
        self.calls.append(f"{self.name}.log_probs")
        return torch.zeros_like(batch["action_mask"], dtype=torch.float32)

    def train(self, batch, kl_coef=0.0, seed=0, entropy_metric=True):
        self.calls.append(f"{self.name}.train")
        return {"policy_loss": 0.5}


class Sync:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def sync(self) -> None:
        self.calls.append("sync")


def test_a_step_calls_the_roles_in_order_and_syncs_after_the_actor_trains():
    for freeze, trained in ((0, True), (1, False)):
        calls: list[str] = []
        # the doctor off: no logger or strategy here to report its alarms to (the next test has them)
        cfg = config("--init_kl_coef", "0.01", "--freezing_actor_steps", str(freeze), "--doctor", "off")
        src = source(cfg, 4, calls)
        trainer = RLTrainer(cfg, Role("actor", calls), src, Sync(calls), src, logger=None, strategy=None,
                            ref=Role("ref", calls))
        state = LoopState()
        metrics = trainer.step(trainer.next_work(state), state)
        training = ["actor.train", "sync"] if trained else []
        assert calls == ["engine.wake", "engine.sleep", "ref.log_probs", "actor.log_probs", *training]
        first = global_batches(4, 2, 7, 0)[0]
        assert metrics["reward"] == sum(i % 2 for i in first) / 4 and ("actor/policy_loss" in metrics) == trained
        assert [r["prompt"] for r in trainer.report_rows()] == [f"p{i}" for i in first for _ in range(2)]


class Recorder:
    """A strategy's print and a metrics logger's log, recorded."""

    def __init__(self):
        self.printed: list[str] = []
        self.logged: list[tuple[int, dict, str]] = []

    def print(self, *args) -> None:
        self.printed.append(" ".join(map(str, args)))

    def log(self, step: int, metrics: dict, prefix: str = "train") -> None:
        self.logged.append((step, metrics, prefix))


def test_the_doctor_sees_every_step_and_reports_its_alarms():
    """Even prompts' two samples both score 0 here (`Reward`): half the groups of each step are all-equal, above
    the doctor's limit set to 0.4, so its equal-reward-groups alarm starts at step 1, printed once and logged once
    as a doctor record."""
    cfg = config("--init_kl_coef", "0", "--doctor_equal_reward_groups_max", "0.4")
    src, out = source(cfg, 4), Recorder()
    trainer = RLTrainer(cfg, Role("actor", []), src, Sync([]), src, logger=out, strategy=out)
    state = LoopState()
    for _ in range(2):
        metrics = trainer.step(trainer.next_work(state), state)
        state.global_step += 1
    assert metrics["reward_groups_all_equal"] == 0.5
    assert [line.split(":")[:3] for line in out.printed] == [["doctor", " step 1", " all-equal reward groups"]]
    assert out.logged == [(1, {"equal_reward_groups": 0.5}, "doctor")]
