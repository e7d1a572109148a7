"""Run assembly, written once for every trainer: strategy, tokenizer, datasets, model (with LoRA), logger, run
directory. `assemble_offline` builds an SFT / reward-model / DPO / KTO run; `prepare_rl_run` and `load_rl_inputs`
give both RL runners (`rl/local_run.py`, `rl/ray_run.py`) their checks, tokenizer, prompts, reward source and step
count.

The configs are typed: `OfflineConfig` is one of the four offline trainers' configs, `RunConfig` any trainer's; what
only an RL run has (a critic's output twin, value-head checks) is in the RL functions, not a branch on the config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import torch

from rlhfkit.config.base import required
from rlhfkit.config.common import LoggingArgs, ModelArgs, StrategyArgs
from rlhfkit.config.paths import check_not_under_a_file
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig
from rlhfkit.config.rl import PPOConfig, is_http, remote_reward_urls, samples_per_rollout
from rlhfkit.config.serving import without_keys
from rlhfkit.config.sft import SFTConfig
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.errors import UserError
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.models.loading import (
    apply_liger_kernel,
    check_model_path,
    load_causal_lm,
    load_model_config,
    load_tokenizer_for,
    quantization_config,
    resolve_attn_implementation,
)
from rlhfkit.models.lora import apply_lora
from rlhfkit.run.checkpoint import latest_checkpoint
from rlhfkit.run.loop import TrainingLoop
from rlhfkit.run.runs import RunInfo, check_compatible, claim_ckpt_dir

OfflineConfig = SFTConfig | RMConfig | DPOConfig | KTOConfig
RunConfig = OfflineConfig | PPOConfig
C = TypeVar("C", bound=OfflineConfig)  # one kind of offline config, the same all through a call


def make_strategy(model_args: ModelArgs, strategy_args: StrategyArgs) -> DeepSpeedStrategy:
    """A strategy whose batch arithmetic is validated; call `setup_distributed()` once inputs are checked."""
    return DeepSpeedStrategy(strategy_args, bf16=model_args.bf16,
                             gradient_checkpointing=model_args.gradient_checkpointing,
                             gradient_checkpointing_use_reentrant=model_args.gradient_checkpointing_use_reentrant)


def load_trainable_lm(model_args: ModelArgs, path: str | None = None, flag: str = "--pretrain") -> Any:
    """A causal LM ready for `strategy.prepare_train` (fp32 master weights, LoRA applied if asked, a 4-bit base
    with --load_in_4bit, Liger's kernels with --use_liger_kernel)."""
    path = check_model_path(path or model_args.pretrain, flag)
    attn = resolve_attn_implementation(model_args.attn_implementation, model_args.flash_attn)
    quantization = quantization_config(model_args.load_in_4bit, model_args.lora_rank, model_args.bf16)
    model = load_causal_lm(path, attn_implementation=attn, dtype=torch.float32, flag=flag, quantization=quantization)
    if model_args.use_liger_kernel:
        apply_liger_kernel(model)
    if model_args.lora_rank <= 0:
        return model
    adapted = apply_lora(model, model_args.lora_rank, model_args.lora_alpha, model_args.lora_dropout,
                         model_args.target_modules)
    if model_args.gradient_checkpointing:
        adapted.enable_input_require_grads()
    return adapted


# -- fail before the work -----------------------------------------------------------------------------------
def check_writable(path: str, flag: str) -> None:
    """UserError unless `path` can be created (or written) as a directory: its nearest existing ancestor must be a
    writable directory, and nothing on the way may be a file. Creates nothing."""
    probe = check_not_under_a_file(path, flag)
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {probe} ({e.strerror}); choose a writable {flag}") from None


def output_dirs(cfg: RunConfig) -> list[tuple[str, str]]:
    """(directory, flag) of everything every run writes: model, checkpoints, metrics, TensorBoard."""
    c, log = cfg.checkpoint, cfg.logging
    dirs = [(c.save_path, "--save_path"), (c.ckpt_path, "--ckpt_path")]
    if log.metrics_path:
        dirs.append((os.path.dirname(os.path.abspath(log.metrics_path)), "--metrics_path"))
    if log.use_tensorboard:
        dirs.append((log.use_tensorboard, "--use_tensorboard"))
    return dirs


def prepare_run(cfg: RunConfig, kind: str, *, extra_outputs: Sequence[tuple[str, str]] = (),
                model_checks: Callable[[], None] | None = None) -> RunInfo:
    """What every trainer checks before it loads a model (its flags were validated when parsed): every output directory
    (`output_dirs` and `extra_outputs`) writable, then `model_checks` (e.g. RL reward/critic models really carrying a
    value head), and the checkpoint directory this run's own (`rlhfkit.run.runs.claim_ckpt_dir`). Returns the run's
    identity for its checkpoints."""
    for path, flag in [*output_dirs(cfg), *extra_outputs]:
        check_writable(path, flag)
    if model_checks is not None:
        model_checks()
    c = cfg.checkpoint
    rank0 = os.environ.get("RANK", "0") == "0"
    for note in claim_ckpt_dir(c.ckpt_path, resume=c.load_checkpoint, overwrite=c.overwrite_ckpt, rank0=rank0):
        if rank0:
            print(note, flush=True)
    run = RunInfo(kind, without_keys(dataclasses.asdict(cfg)))
    if c.load_checkpoint:  # another trainer's or model's checkpoint: refused now rather than after the model loads
        newest = latest_checkpoint(c.ckpt_path)
        if newest is not None:
            check_compatible(newest, run)
    return run


def run_name(kind: str) -> str:
    return f"{kind}_{datetime.now():%Y%m%d_%H%M%S}"


def make_logger(strategy: DeepSpeedStrategy, logging_args: LoggingArgs, save_path: str, kind: str,
                config: RunConfig) -> MetricsLogger:
    """Metrics sinks on rank 0; the config is saved next to the metrics for reproducibility."""
    as_dict = without_keys(dataclasses.asdict(config))  # no bearer token in the saved config or W&B
    if strategy.is_rank0:
        os.makedirs(save_path, exist_ok=True)
        with open(os.path.join(save_path, "rlhfkit_args.json"), "w") as f:
            json.dump(as_dict, f, indent=1, default=str)
    return MetricsLogger(logging_args, save_path, run_name(kind), as_dict, enabled=strategy.is_rank0)


def build_strategy(model_args: ModelArgs, strategy_args: StrategyArgs) -> DeepSpeedStrategy:
    """`make_strategy` and join the process group at once (when no input checks must come first)."""
    strategy = make_strategy(model_args, strategy_args)
    strategy.setup_distributed()
    return strategy


# -- the offline runs (train_sft, train_rm, train_dpo, train_kto) -------------------------------------------
def check_enough_samples(train: Sequence[Any], train_batch_size: int) -> None:
    if len(train) < train_batch_size:
        raise UserError(f"--dataset has {len(train)} usable samples, fewer than one --train_batch_size "
                        f"({train_batch_size})")


class Fits(Protocol):
    """A trainer as `OfflineRun.fit_and_save` runs it."""

    def fit(self) -> list[dict[str, float]]: ...


@dataclass
class OfflineRun:
    """What an offline trainer's run is made of: the strategy (in its process group), tokenizer, datasets, the
    trainable model's engine with the run's optimizer-step count, the metrics logger and the run's identity."""

    strategy: DeepSpeedStrategy
    tokenizer: Any
    train: Any
    evalset: Any
    steps: int
    engine: Any
    logger: MetricsLogger
    run: RunInfo  # the identity the trainer's checkpoints carry
    attn: str  # the attention implementation the flags resolve to (for more models, e.g. a reference)
    processor_dir: str | None = None  # where the model's image processor is (a vision-language model's)

    def fit_and_save(self, trainer: Fits, save_path: str, kind: str,
                     before_save: Callable[[], None] | None = None) -> None:
        """Train, run `before_save` (e.g. reward statistics into the model config), save the model as a Hugging
        Face directory, close the logger whatever happens."""
        try:
            trainer.fit()
            if before_save is not None:
                before_save()
            self.strategy.save_hf_model(self.engine, self.tokenizer, save_path)
            copy_image_processor(self.processor_dir, save_path, self.strategy.is_rank0)
        finally:
            self.logger.close()
        self.strategy.print(f"{kind}: model saved to {save_path}; metrics in {self.logger.path}")


def copy_image_processor(source: str | None, save_path: str, rank0: bool) -> None:
    """A vision-language model's `preprocessor_config.json` next to its saved weights, so the saved directory is a
    complete `--pretrain` for the next stage (the tokenizer is saved with the model already)."""
    import shutil

    config = os.path.join(source, "preprocessor_config.json") if source else ""
    if rank0 and config and os.path.isfile(config):
        shutil.copy(config, os.path.join(save_path, "preprocessor_config.json"))


def load_record_images(cfg: OfflineConfig | PPOConfig, tokenizer: Any) -> Any:
    """The reader of --image_key images (`rlhfkit.data.images.RecordImages`) for the run's model; None without
    --image_key. A text-only --pretrain is a UserError here, before any model loads."""
    vision = getattr(cfg, "vision", None)
    if vision is None or not vision.image_key:
        return None
    from rlhfkit.models.vision import record_images

    path = check_model_path(cfg.model.pretrain)
    return record_images(load_model_config(path), path, tokenizer, vision.image_key, vision.max_images_per_prompt)


def assemble_offline(cfg: C, kind: str, load_datasets: Callable[[C, Any], tuple[Any, Any]], *,
                     load_model: Callable[[C], Any] | None = None,
                     model_paths: Sequence[tuple[str | None, str]] = ()) -> OfflineRun:
    """Assemble an offline run. Everything that can fail on the user's input fails before the process group
    starts: the batch arithmetic (`make_strategy`), the outputs and the checkpoint directory (`prepare_run`), the
    attention implementation (--flash_attn needs a GPU), --pretrain and the other `model_paths` ((path or None,
    flag)), the datasets (`load_datasets(cfg, tokenizer)` -> (train, eval or None); at least one
    --train_batch_size of samples). Then it joins the group, loads the model (`load_model(cfg)`, default the causal
    LM of `load_trainable_lm`) into a training engine and opens the logger."""
    from rlhfkit.models.loading import check_model_path

    strategy = make_strategy(cfg.model, cfg.strategy)  # validates batch arithmetic, joins no group yet
    run = prepare_run(cfg, kind)
    attn = resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn)
    check_model_path(cfg.model.pretrain)
    for path, flag in model_paths:
        if path:
            check_model_path(path, flag)
    tokenizer = load_tokenizer_for(cfg.model)
    train, evalset = load_datasets(cfg, tokenizer)
    check_enough_samples(train, cfg.strategy.train_batch_size)
    strategy.setup_distributed()
    steps = (len(train) // cfg.strategy.train_batch_size) * cfg.train.max_epochs
    model = load_model(cfg) if load_model is not None else load_trainable_lm(cfg.model)
    vision = getattr(cfg, "vision", None)
    if vision is not None and vision.freeze_visual_encoder:
        from rlhfkit.models.vision import freeze_visual_encoder

        strategy.print(f"{kind}: --freeze_visual_encoder: {freeze_visual_encoder(model)} vision tensors frozen")
    engine = strategy.prepare_train(model, cfg.strategy.learning_rate, steps)
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, kind, cfg)
    return OfflineRun(strategy, tokenizer, train, evalset, steps, engine, logger, run, attn,
                      processor_dir=check_model_path(cfg.model.pretrain))


# -- the RL runs (train_ppo, train_ppo_ray) ------------------------------------------------------------------
def check_value_heads(cfg: PPOConfig) -> None:
    """A --reward_pretrain / --critic_pretrain without a trained value head, before any model loads."""
    from rlhfkit.config.rl import CRITIC_HEAD_HINT, critic_needs_head
    from rlhfkit.models.value_model import check_value_head

    m = cfg.rl_model
    if m.reward_pretrain:
        check_value_head(m.reward_pretrain, m.value_head_prefix, "--reward_pretrain")
    if m.critic_pretrain and critic_needs_head(cfg):
        check_value_head(m.critic_pretrain, m.value_head_prefix, "--critic_pretrain", CRITIC_HEAD_HINT)


def prepare_rl_run(cfg: PPOConfig, kind: str) -> RunInfo:
    """`prepare_run` of an RL run: also the critic's --save_path twin (--save_value_network) writable and the
    reward / critic models carrying value heads."""
    twin = [(cfg.checkpoint.save_path.rstrip("/") + "_critic", "--save_path (its _critic twin)")]
    return prepare_run(cfg, kind, extra_outputs=twin if cfg.save.save_value_network else (),
                       model_checks=lambda: check_value_heads(cfg))


def load_prompts(cfg: PPOConfig, tokenizer: Any) -> tuple[Any, Any | None]:
    """(training prompts, evaluation prompts or None) as PromptDatasets."""
    from rlhfkit.data.prompt_dataset import PromptDataset
    from rlhfkit.data.readers import load_mixture

    d = cfg.data
    records = load_mixture(required(d.prompt_data, "prompt_data"), d.prompt_data_probs, d.prompt_split,
                           d.max_samples, cfg.strategy.seed, arg_name="--prompt_data")
    images = load_record_images(cfg, tokenizer)  # --image_key: read and processed once, here
    prompts = PromptDataset.from_args(records, tokenizer, d, images)
    eval_prompts = None
    if d.eval_dataset:
        eval_records = load_mixture(d.eval_dataset, None, d.eval_split, None, cfg.strategy.seed,
                                    arg_name="--eval_dataset")
        eval_prompts = PromptDataset.from_args(eval_records, tokenizer, d, images)
    if len(prompts) < cfg.rollout.rollout_batch_size:
        raise UserError(f"--prompt_data has {len(prompts)} prompts, fewer than one --rollout_batch_size "
                        f"({cfg.rollout.rollout_batch_size})")
    return prompts, eval_prompts


def num_update_steps(cfg: PPOConfig, num_prompts: int) -> int:
    """Optimizer steps of the whole run (for the learning-rate schedules)."""
    r = cfg.rollout
    rollout_steps = (num_prompts // r.rollout_batch_size) * r.num_episodes
    per_rollout = samples_per_rollout(cfg) // cfg.strategy.train_batch_size
    return max(rollout_steps * per_rollout * r.max_epochs, 1)


def make_text_reward(cfg: PPOConfig) -> Any:
    """The --remote_rm_url source: HTTP reward servers, or a reward function file in its worker pool. None with
    --agent_func_path (the episodes' step rewards are the reward), after importing the agent file once here so that
    a broken one fails before any model loads."""
    from rlhfkit.rewards.sources import RewardFunction, make_remote_reward, reward_file

    if cfg.agent.agent_func_path:
        from rlhfkit.agents.episodes import load_agent_executor

        load_agent_executor(cfg.agent.agent_func_path, cfg.user_code.reward_timeout)  # first in a worker
        return None
    m, code, urls = cfg.rl_model, cfg.user_code, remote_reward_urls(cfg)
    if any(is_http(url) for url in urls):
        return make_remote_reward(urls, timeout=m.remote_rm_timeout, retries=m.remote_rm_retries)
    return RewardFunction(reward_file(urls[0]), workers=code.reward_workers, timeout=code.reward_timeout,
                          fallback=code.reward_fallback, max_failure_ratio=code.max_reward_failure_ratio,
                          call_size=cfg.rollout.micro_rollout_batch_size)


@dataclass
class RLInputs:
    """What both RL runners load before any model: the tokenizer, the prompts, the text reward source (None with
    --reward_pretrain: a reward model scores) and the run's optimizer-step count."""

    tokenizer: Any
    prompts: Any
    eval_prompts: Any
    text_reward: Any
    num_update_steps: int

    def close(self) -> None:
        """Stop the reward function's worker pool, if the run has one."""
        if hasattr(self.text_reward, "close"):
            self.text_reward.close()


def load_rl_inputs(cfg: PPOConfig, tokenizer_apart: bool = False) -> RLInputs:
    """The tokenizer (`tokenizer_apart`: loaded in a forked child, for a driver that loads no model), the prompts,
    the text reward source and the optimizer-step count of an RL run."""
    tokenizer = load_tokenizer_for(cfg.model, apart=tokenizer_apart)
    prompts, eval_prompts = load_prompts(cfg, tokenizer)
    text_reward = make_text_reward(cfg) if not cfg.rl_model.reward_pretrain else None
    return RLInputs(tokenizer, prompts, eval_prompts, text_reward, num_update_steps(cfg, len(prompts)))


def train_rl(cfg: PPOConfig, strategy: Any, kind: str, assemble: Callable[[MetricsLogger], TrainingLoop], *,
             save: bool = True, before_fit: Callable[[TrainingLoop], None] | None = None) -> Any:
    """Open the logger, assemble the RL run over it (`assemble(logger)`: the shared `TrainingLoop` around an
    `rlhfkit.rl.trainer.RLTrainer` the runner composed), run `before_fit(loop)`, train, close the trainer's batch
    supply (the async generator), save the final model(s); the logger is closed whatever happens. Returns the
    trainer."""
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, kind, cfg)
    try:
        loop = assemble(logger)
        trainer: Any = loop.trainer
        if before_fit is not None:
            before_fit(loop)
        try:
            loop.fit()
        finally:
            trainer.close()
        if save:
            trainer.save_final()
            # a vision-language policy's image processor too: the saved model is a complete --pretrain
            copy_image_processor(cfg.model.pretrain, cfg.checkpoint.save_path, strategy.is_rank0)
    finally:
        logger.close()
    strategy.print(f"{cfg.algo.advantage_estimator}: model saved to {cfg.checkpoint.save_path}; metrics in "
                   f"{logger.path}")
    return trainer
