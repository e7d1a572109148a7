"""Config of `rlhfkit.cli.train_ppo` (and, next, `train_ppo_ray`): online RL with one loop for every estimator.

Flag names are OpenRLHF's (`--advantage_estimator group_norm --n_samples_per_prompt 8 ...`). `PPOConfig.validate`
(run by `parse_config`) fails fast, with one line, on flags that cannot run: batch sizes that do not divide, a group
estimator with one sample per prompt, a dual clip <= 1; `PPOConfig.check_inputs` (run by the trainers) on missing
inputs: no model, no prompts, no reward source, a reward function file that is not there. The distributed flags
(role placement, vLLM engines, colocation, sleep) are accepted and checked here, and `train_ppo_ray` acts on them;
the single-process trainer runs every role in one process with the Transformers rollout engine and refuses vLLM
engines (`validate_single_process`). A flag given where it cannot act is refused (`PPOConfig.inert_flags`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlhfkit.config.backend import check_fsdp2_for_rl
from rlhfkit.config.base import validate_sections
from rlhfkit.config.common import (
    CheckpointArgs,
    DryRunArgs,
    LoggingArgs,
    ModelArgs,
    StrategyArgs,
    check_aux_loss_flags,
    check_batch_split,
    check_token_budget,
)
from rlhfkit.config.critic_optim import CriticOptimArgs, check_critic_optimizer
from rlhfkit.config.distill import DistillArgs
from rlhfkit.config.lora_sync import lora_sync_mode
from rlhfkit.config.names import (
    GROUP_BASELINES,
)
from rlhfkit.config.paths import check_output_paths
from rlhfkit.config.rl_inert import inert_flags
from rlhfkit.config.rl_resources import ROLES as ROLES
from rlhfkit.config.rl_resources import check_positive as _positive
from rlhfkit.config.rl_resources import needs_critic as needs_critic
from rlhfkit.config.rl_resources import needs_reference as needs_reference
from rlhfkit.config.rl_resources import role_needed as role_needed
from rlhfkit.config.rl_resources import role_ranks, validate_placement, validate_resources
from rlhfkit.config.rl_sections import (
    AgentArgs,
    AlgorithmArgs,
    AsyncArgs,
    DoctorArgs,
    RecipeArgs,
    ResourceArgs,
    RLDataArgs,
    RLModelArgs,
    RLSaveArgs,
    RLStrategyArgs,
    RolloutArgs,
    UserCodeArgs,
)
from rlhfkit.config.sequence_parallel import check_rl_ring
from rlhfkit.config.specs import CRITIC_HEAD_HINT as CRITIC_HEAD_HINT
from rlhfkit.config.vision import VisionArgs, check_rl_vision, vision_inert_flags
from rlhfkit.errors import UserError


@dataclass
class PPOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    rl_model: RLModelArgs = field(default_factory=RLModelArgs)
    user_code: UserCodeArgs = field(default_factory=UserCodeArgs)
    agent: AgentArgs = field(default_factory=AgentArgs)
    strategy: RLStrategyArgs = field(default_factory=RLStrategyArgs)
    data: RLDataArgs = field(default_factory=RLDataArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    algo: AlgorithmArgs = field(default_factory=AlgorithmArgs)
    critic_optim: CriticOptimArgs = field(default_factory=CriticOptimArgs)
    recipe: RecipeArgs = field(default_factory=RecipeArgs)
    asynchronous: AsyncArgs = field(default_factory=AsyncArgs)
    resources: ResourceArgs = field(default_factory=ResourceArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)
    save: RLSaveArgs = field(default_factory=RLSaveArgs)
    doctor: DoctorArgs = field(default_factory=DoctorArgs)
    distill: DistillArgs = field(default_factory=DistillArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        check_fsdp2_for_rl(self)
        check_rl_ring(self, {r: role_ranks(self, r) for r in ROLES if role_needed(self, r)})  # --ring_attn_size
        _validate_reward_flags(self)
        validate_resources(self)  # before the batch arithmetic, which divides by the actor's device count
        _validate_batches(self)
        _validate_algorithm(self)
        _validate_recipe(self)
        _validate_async(self)
        lora_sync_mode(self.rollout.lora_sync, self.model.lora_rank, engine_backend(self))
        validate_placement(self)  # colocation and each role's batch split (rules of train_ppo_ray's placement)
        check_rl_vision(self)  # image prompts: which roles may see them

    def inert_flags(self) -> dict[str, str]:
        """The flags that cannot act in this run's layout, with why (`rl_inert.inert_flags`)."""
        return {**inert_flags(self), **vision_inert_flags(self.vision)}

    def check_inputs(self) -> None:
        """What the run needs besides valid flags: a policy, prompts, a reward source, the files named (the
        trainers call it before reading anything)."""
        _check_sources(self)
        check_output_paths(self)


# -- derived settings ---------------------------------------------------------------------------------------
def clip_range(cfg: PPOConfig) -> tuple[float, float]:
    """(clip_eps_low, clip_eps_high), each defaulting to --eps_clip."""
    a = cfg.algo
    return (a.eps_clip if a.clip_eps_low is None else a.clip_eps_low,
            a.eps_clip if a.clip_eps_high is None else a.clip_eps_high)


def engine_backend(cfg: PPOConfig, single_process: bool = False) -> str:
    """The rollout engines' backend: vLLM with --vllm_num_engines N > 0 (train_ppo_ray), else Transformers; image
    prompts always take the Transformers engine (`vision_engine_note` says why)."""
    vllm = cfg.rollout.vllm_num_engines > 0 and not single_process and not cfg.vision.image_key
    return "vllm" if vllm else "transformers"


def critic_path(cfg: PPOConfig) -> str | None:
    """The critic's initialisation, OpenRLHF's default: --critic_pretrain, else --reward_pretrain, else --pretrain."""
    return cfg.rl_model.critic_pretrain or cfg.rl_model.reward_pretrain or cfg.model.pretrain


def critic_needs_head(cfg: PPOConfig) -> bool:
    """Whether the critic's initialisation must carry a trained value head: it does when the user named a reward
    model or critic (a plain model there is usually a wrong path), not for the default critic from --pretrain."""
    m = cfg.rl_model
    return bool(m.critic_pretrain or m.reward_pretrain) and not m.critic_init_head


def loss_aggregation(cfg: PPOConfig) -> str:
    if cfg.algo.policy_loss_agg != "auto":
        return cfg.algo.policy_loss_agg
    return "seq_mean_token_sum_norm" if cfg.algo.advantage_estimator == "dr_grpo" else "token_mean"


def samples_per_rollout(cfg: PPOConfig) -> int:
    return cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt


def remote_reward_urls(cfg: PPOConfig) -> list[str]:
    url = cfg.rl_model.remote_rm_url
    return [u.strip() for u in url.split(",") if u.strip()] if url else []


BUILT_IN_REASONING_GYM = "reasoning_gym"  # --remote_rm_url reasoning_gym: rewards/reasoning_gym_reward.py


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


# -- validation ---------------------------------------------------------------------------------------------
def _validate_batches(cfg: PPOConfig) -> None:
    r, s = cfg.rollout, cfg.strategy
    _positive({"rollout_batch_size": r.rollout_batch_size, "micro_rollout_batch_size": r.micro_rollout_batch_size,
               "n_samples_per_prompt": r.n_samples_per_prompt, "train_batch_size": s.train_batch_size,
               "micro_train_batch_size": s.micro_train_batch_size, "num_episodes": r.num_episodes,
               "max_epochs": r.max_epochs, "eval_n_samples_per_prompt": r.eval_n_samples_per_prompt,
               "prompt_max_len": cfg.data.prompt_max_len, "generate_max_len": cfg.data.generate_max_len,
               "max_samples": cfg.data.max_samples})
    samples = samples_per_rollout(cfg)
    if samples % s.train_batch_size:
        raise UserError(f"--rollout_batch_size {r.rollout_batch_size} x --n_samples_per_prompt "
                        f"{r.n_samples_per_prompt} = {samples} samples per step is not divisible by "
                        f"--train_batch_size {s.train_batch_size}; make the samples a multiple of it")
    check_batch_split(s.train_batch_size, s.micro_train_batch_size, role_ranks(cfg, "actor") // s.ring_attn_size,
                      "actor devices" if s.ring_attn_size == 1 else "actor devices / --ring_attn_size")
    if samples % r.micro_rollout_batch_size:
        raise UserError(f"{samples} samples per step (--rollout_batch_size x --n_samples_per_prompt) are not "
                        f"divisible by --micro_rollout_batch_size {r.micro_rollout_batch_size}")
    check_token_budget(s, cfg.data.prompt_max_len + cfg.data.generate_max_len, "--prompt_max_len + --generate_max_len")
    _check_scoring_budget(cfg)


def _check_scoring_budget(cfg: PPOConfig) -> None:
    """--rollout_max_tokens_per_gpu: a token budget like --max_tokens_per_gpu's, for the scoring forwards."""
    budget, longest = cfg.rollout.rollout_max_tokens_per_gpu, cfg.data.prompt_max_len + cfg.data.generate_max_len
    if budget is None:
        return
    if not cfg.strategy.use_dynamic_batch:
        raise UserError("--rollout_max_tokens_per_gpu only applies with --use_dynamic_batch; add that flag or drop it")
    if budget < longest:
        raise UserError(f"--rollout_max_tokens_per_gpu {budget} is smaller than the longest possible sample "
                        f"({longest} tokens: --prompt_max_len + --generate_max_len); raise it to at least {longest}")


def _validate_algorithm(cfg: PPOConfig) -> None:
    a, r = cfg.algo, cfg.rollout
    if a.advantage_estimator in GROUP_BASELINES and r.n_samples_per_prompt < 2:
        raise UserError(f"--advantage_estimator {a.advantage_estimator} compares the samples of one prompt and "
                        f"needs --n_samples_per_prompt > 1 (got {r.n_samples_per_prompt})")
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        raise UserError(f"--dual_clip must be > 1 (got {a.dual_clip})")
    if a.dual_clip is not None and a.policy_loss_type in ("cispo", "sapo"):
        raise UserError(f"--dual_clip bounds PPO's clipped surrogate; --policy_loss_type {a.policy_loss_type} has "
                        "none, drop --dual_clip")
    if a.tau_pos <= 0 or a.tau_neg <= 0:
        raise UserError(f"--tau_pos and --tau_neg must be > 0 (got {a.tau_pos}, {a.tau_neg})")
    low, high = clip_range(cfg)
    if low < 0 or high < 0:
        raise UserError(f"clip ranges must be >= 0 (--eps_clip / --clip_eps_low / --clip_eps_high: {low}, {high})")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lambd <= 1:
        raise UserError(f"--gamma and --lambd must be in [0, 1] (got {a.gamma}, {a.lambd})")
    if a.init_kl_coef < 0:
        raise UserError(f"--init_kl_coef must be >= 0 (got {a.init_kl_coef})")
    if a.kl_target is not None and (a.kl_target <= 0 or a.kl_horizon <= 0):
        raise UserError(f"--kl_target and --kl_horizon must be > 0 (got {a.kl_target}, {a.kl_horizon})")
    if a.value_clip is not None and a.value_clip <= 0:
        raise UserError(f"--value_clip must be > 0 (got {a.value_clip})")
    if a.entropy_loss_coef < 0:
        raise UserError(f"--entropy_loss_coef must be >= 0 (got {a.entropy_loss_coef})")
    check_aux_loss_flags(a.aux_loss_coef, cfg.data.packing_samples)
    if a.enable_vllm_is_correction:
        is_bounds(cfg)
    if a.reward_clip_range is not None:
        if len(a.reward_clip_range) not in (1, 2):
            raise UserError(f"--reward_clip_range takes one or two numbers (got {a.reward_clip_range})")
        bounds = reward_clip_bounds(cfg)
        if bounds is not None and not bounds[0] < bounds[1]:
            raise UserError(f"--reward_clip_range {a.reward_clip_range}: low must be below high")
    _positive({"actor_learning_rate": a.actor_learning_rate})
    if needs_critic(cfg):
        _positive({"critic_learning_rate": a.critic_learning_rate})
        check_critic_optimizer(cfg.strategy, cfg.critic_optim)
    if not r.temperature > 0:
        raise UserError(f"--temperature must be > 0 (got {r.temperature})")
    if r.eval_temperature < 0:
        raise UserError(f"--eval_temperature must be >= 0 (got {r.eval_temperature}; 0 is greedy)")
    if not 0 < r.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] (got {r.top_p})")
    if cfg.strategy.learning_rate != StrategyArgs.learning_rate:
        raise UserError("--learning_rate does not apply to RL; use --actor_learning_rate and "
                        "--critic_learning_rate")


def is_bounds(cfg: PPOConfig) -> tuple[float, float]:
    """(LO, HI) of the importance-sampling correction; one value is the cap HI with LO = 0."""
    values = cfg.algo.vllm_is_truncated_threshold
    if len(values) not in (1, 2):
        raise UserError(f"--vllm_is_truncated_threshold takes LO HI or one cap (got {values})")
    low, high = (0.0, float(values[0])) if len(values) == 1 else (float(values[0]), float(values[1]))
    if not 0 <= low < high:
        raise UserError(f"--vllm_is_truncated_threshold {values}: need 0 <= LO < HI (a cap > 0)")
    return low, high


def dynamic_filtering_range(cfg: PPOConfig) -> tuple[float, float]:
    values = cfg.recipe.dynamic_filtering_reward_range
    if len(values) != 2 or not values[0] < values[1]:
        raise UserError(f"--dynamic_filtering_reward_range takes LO HI with LO < HI (got {values})")
    return float(values[0]), float(values[1])


def _validate_recipe(cfg: PPOConfig) -> None:
    rc, s = cfg.recipe, cfg.save
    if rc.overlong_buffer_len is not None and not 0 < rc.overlong_buffer_len <= cfg.data.generate_max_len:
        raise UserError(f"--overlong_buffer_len must be in (0, --generate_max_len={cfg.data.generate_max_len}] "
                        f"(got {rc.overlong_buffer_len})")
    if rc.overlong_penalty_factor < 0:
        raise UserError(f"--overlong_penalty_factor must be >= 0 (got {rc.overlong_penalty_factor})")
    if rc.stop_properly_penalty_coef is not None and rc.stop_properly_penalty_coef > 1:
        raise UserError(f"--stop_properly_penalty_coef must be <= 1 (got {rc.stop_properly_penalty_coef}): a "
                        "coef in [0, 1] scales a truncated response's reward, a negative one replaces it")
    if rc.dynamic_filtering:
        dynamic_filtering_range(cfg)
        if cfg.rollout.n_samples_per_prompt < 2:
            raise UserError("--dynamic_filtering compares the samples of one prompt and needs "
                            f"--n_samples_per_prompt > 1 (got {cfg.rollout.n_samples_per_prompt})")
        _positive({"dynamic_filtering_max_rounds": rc.dynamic_filtering_max_rounds})
    if s.enable_ema and not 0 < s.ema_beta < 1:
        raise UserError(f"--ema_beta must be in (0, 1) (got {s.ema_beta})")
    if s.best_metric_key is not None:
        if not s.best_metric_key.startswith("eval/"):
            raise UserError(f"--best_metric_key {s.best_metric_key}: only eval metrics can pick the best model "
                            "(e.g. eval/pass@1, eval/reward)")
        if not cfg.data.eval_dataset:
            raise UserError(f"--best_metric_key {s.best_metric_key} needs --eval_dataset to evaluate on")


def reward_clip_bounds(cfg: PPOConfig) -> tuple[float, float] | None:
    values = cfg.algo.reward_clip_range
    if not values:
        return None
    if len(values) == 1:
        return -abs(values[0]), abs(values[0])
    return float(values[0]), float(values[1])


def _validate_reward_flags(cfg: PPOConfig) -> None:
    """The reward source's flags: one kind of source, an agent alone, the remote reward's retry settings."""
    m, a = cfg.rl_model, cfg.agent
    urls = remote_reward_urls(cfg)
    if a.agent_func_path is None and a.max_steps is not None:
        raise UserError(f"--max_steps {a.max_steps} is the turn budget of an agent episode and needs "
                        "--agent_func_path; to stop after N RL steps use --max_rl_steps N (renamed)")
    if a.agent_func_path is not None and (m.reward_pretrain or m.remote_rm_url):
        raise UserError("--agent_func_path: the agent's step rewards are the reward; drop --reward_pretrain / "
                        "--remote_rm_url")
    if a.agent_func_path is None and a.tool_format is not None:
        raise UserError(f"--tool_format {a.tool_format} is read by a tool agent and needs --agent_func_path")
    if a.max_steps is not None and a.max_steps < 1:
        raise UserError(f"--max_steps must be >= 1 turn (got {a.max_steps})")
    if m.reward_pretrain and urls:
        raise UserError("pass either --reward_pretrain or --remote_rm_url, not both")
    if len(urls) > 1 and not all(is_http(u) for u in urls):
        raise UserError(f"--remote_rm_url {m.remote_rm_url}: several sources must all be http(s) URLs; a reward "
                        "function file stands alone")
    if m.remote_rm_retries < 1 or m.remote_rm_timeout <= 0:
        raise UserError("--remote_rm_retries must be >= 1 and --remote_rm_timeout > 0")
    if m.critic_init_head and not m.critic_pretrain:
        raise UserError("--critic_init_head applies to the model given as --critic_pretrain; pass one, or drop the "
                        "flag (the default critic from --pretrain starts with a new head anyway)")


def _check_sources(cfg: PPOConfig) -> None:
    m, d = cfg.rl_model, cfg.data
    if not cfg.model.pretrain:
        raise UserError("--pretrain is required: the policy to train (a Hugging Face model directory)")
    if not d.prompt_data:
        raise UserError("--prompt_data is required: the RL prompts (a local json/jsonl/parquet/csv file)")
    if cfg.agent.agent_func_path is not None:
        path = Path(cfg.agent.agent_func_path).expanduser()
        if path.suffix != ".py" or not path.is_file():
            raise UserError(f"--agent_func_path {cfg.agent.agent_func_path}: not an existing .py file")
    elif not m.reward_pretrain and not remote_reward_urls(cfg):
        raise UserError("no reward source: pass --reward_pretrain (a reward model) or --remote_rm_url (a Python "
                        "file with reward_func, or http://host:port/get_reward)")
    for url in (u for u in remote_reward_urls(cfg) if not is_http(u) and u != BUILT_IN_REASONING_GYM):
        p = Path(url).expanduser()
        if p.suffix != ".py" or not p.is_file():
            raise UserError(f"--remote_rm_url {url}: not an http(s) URL and not an existing .py file")


def _validate_async(cfg: PPOConfig) -> None:
    """--async_train and its companions (train_ppo_ray only: `validate_single_process` refuses them)."""
    a, r = cfg.asynchronous, cfg.rollout
    if not a.async_train:
        for flag, value in (("async_queue_size", a.async_queue_size != AsyncArgs.async_queue_size),
                            ("partial_rollout", a.partial_rollout),
                            ("vllm_generate_batch_size", a.vllm_generate_batch_size is not None)):
            if value:
                raise UserError(f"--{flag} applies to asynchronous training; add --async_train")
        return
    if a.async_queue_size < 1:
        raise UserError(f"--async_queue_size must be >= 1 batch (got {a.async_queue_size})")
    if a.partial_rollout:
        if not cfg.algo.enable_vllm_is_correction:
            raise UserError("--partial_rollout mixes policy versions inside a response; it needs the "
                            "importance-sampling correction: add --enable_vllm_is_correction")
        _positive({"partial_rollout_chunk_len": a.partial_rollout_chunk_len})
    g = a.vllm_generate_batch_size
    if g is not None:
        if g <= r.rollout_batch_size or g % r.rollout_batch_size:
            raise UserError(f"--vllm_generate_batch_size {g} must be a multiple of --rollout_batch_size "
                            f"{r.rollout_batch_size} above it (the extra batches are queued for the next steps)")
        if g // r.rollout_batch_size > a.async_queue_size:
            raise UserError(f"--vllm_generate_batch_size {g} makes {g // r.rollout_batch_size} batches per engine "
                            f"call, more than --async_queue_size {a.async_queue_size} holds; raise the queue size "
                            "to at least that (it bounds how stale a sample may be)")
        if cfg.recipe.dynamic_filtering:
            raise UserError("--vllm_generate_batch_size with --dynamic_filtering is not supported yet (dynamic "
                            "sampling refills each batch itself); drop one of them")
    if r.vllm_enable_sleep:
        raise UserError("--async_train generates while the actor trains, so the engines never sleep; drop "
                        "--vllm_enable_sleep")


def validate_single_process(cfg: PPOConfig) -> None:
    """What only train_ppo_ray runs: asynchronous training needs the generator as its own Ray actor, and vLLM
    engines are Ray actors too (the single-process run generates with the Transformers engine)."""
    if cfg.rollout.vllm_num_engines > 0:
        raise UserError(f"--vllm_num_engines {cfg.rollout.vllm_num_engines}: train_ppo runs every role in this "
                        "process and generates with the Transformers engine; drop it, or run vLLM engines with "
                        "python -m rlhfkit.cli.train_ppo_ray")
    if cfg.asynchronous.async_train:
        raise UserError("--async_train needs a generator actor beside the trainer: run it with "
                        "python -m rlhfkit.cli.train_ppo_ray")

