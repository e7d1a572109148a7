"""Config of `rlhfkit.cli.train_ppo` (and, next, `train_ppo_ray`): online RL with one loop for every estimator.

Flag names are OpenRLHF's (`--advantage_estimator group_norm --n_samples_per_prompt 8 ...`). `PPOConfig.validate`
(run by `parse_config`) fails fast, with one line, on flags that cannot run: batch sizes that do not divide, a group
estimator with one sample per prompt, a dual clip <= 1; `PPOConfig.check_inputs` (run by the trainers) on missing
inputs: no model, no prompts, no reward source, a reward function file that is not there. The distributed flags
(role placement, vLLM engines, colocation, sleep) are accepted and checked here; the single-process trainer runs
every role in one process with the Transformers rollout engine, and `train_ppo_ray` acts on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rlhfkit.config.base import arg, validate_sections
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
from rlhfkit.config.names import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    GROUP_BASELINES,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSS_TYPES,
)
from rlhfkit.errors import UserError

LOSS_AGGREGATIONS = ("auto", *AGGREGATION_MODES)


@dataclass
class RLModelArgs:
    reward_pretrain: str | None = arg(None, "Reward model directory (a model trained by train_rm, read at the last "
                                            "token); or use --remote_rm_url.")
    critic_pretrain: str | None = arg(None, "Critic initialisation for --advantage_estimator gae (default: "
                                            "--reward_pretrain, else --pretrain).")
    remote_rm_url: str | None = arg(None, "Reward without a reward model: a Python file defining reward_func("
                                          "queries, prompts, labels), or comma-separated HTTP reward servers "
                                          "(http://host:port/get_reward).")
    value_head_prefix: str = arg("score", "Attribute name of the linear value head of the reward model / critic.")
    critic_init_head: bool = arg(False, "Start the critic from a --critic_pretrain that has no trained value head "
                                        "(a plain language model) with a freshly initialised head; without it "
                                        "such a model is an error. The default critic, from --pretrain when no "
                                        "critic or reward model is given, always starts this way.")
    remote_rm_timeout: float = arg(60.0, "Seconds one HTTP reward request may take before it is retried.")
    remote_rm_retries: int = arg(3, "Attempts per HTTP reward request before the run stops with an error.")


@dataclass
class UserCodeArgs:
    reward_workers: int = arg(2, "Worker processes that run a --remote_rm_url reward function file (a batch is "
                                 "scored in calls of --micro_rollout_batch_size samples spread over them), or the "
                                 "AgentInstances of --agent_func_path episodes (per rollout engine).")
    reward_timeout: float = arg(60.0, "Seconds one reward function call (or agent reset/step) may take; a slower "
                                      "call is killed (its worker replaced; an agent's episode ends) and its "
                                      "samples get --reward_fallback.")
    reward_fallback: float = arg(0.0, "Reward (and score) of a sample whose reward function call failed: raised, "
                                      "timed out, crashed, or returned NaN/inf or the wrong number of values (or "
                                      "whose agent episode failed).")
    max_reward_failure_ratio: float = arg(0.1, "Stop the run when more than this fraction of a step's samples "
                                               "failed in the reward function or agent (0: stop at the first "
                                               "failure).")

    def validate(self) -> None:
        if self.reward_workers < 1:
            raise UserError(f"--reward_workers must be >= 1 (got {self.reward_workers})")
        if not self.reward_timeout > 0:
            raise UserError(f"--reward_timeout must be > 0 seconds (got {self.reward_timeout})")
        if not math.isfinite(self.reward_fallback):
            raise UserError(f"--reward_fallback must be a finite number (got {self.reward_fallback})")
        if not 0 <= self.max_reward_failure_ratio <= 1:
            raise UserError(f"--max_reward_failure_ratio must be in [0, 1] (got {self.max_reward_failure_ratio})")


@dataclass
class AgentArgs:
    agent_func_path: str | None = arg(None, "Multi-turn agent file defining AgentExecutor and AgentInstance "
                                            "(import their bases from rlhfkit.agents); its step rewards are the "
                                            "reward, so no --remote_rm_url / --reward_pretrain.")
    max_steps: int | None = arg(None, "Turns per agent episode (with --agent_func_path; default: until done or "
                                      "--generate_max_len tokens). The RL-step cap is --max_rl_steps.")


@dataclass
class RLDataArgs:
    prompt_data: str | None = arg(None, "RL prompts: comma-separated local files (json, jsonl, parquet, csv, "
                                        "arrow) or dataset directories; @split picks a split.")
    prompt_data_probs: str | None = arg(None, "Mixing probabilities of several --prompt_data sources, e.g. 0.3,0.7.")
    prompt_split: str = arg("train", "Split of --prompt_data to read.")
    eval_dataset: str | None = arg(None, "Held-out prompts (with labels) for evaluation during training.")
    eval_split: str = arg("train", "Split of --eval_dataset to read.")
    max_samples: int = arg(10**8, "Use at most this many prompts.")
    input_key: str = arg("input", "Record key of the prompt (a string, or a message list with "
                                  "--apply_chat_template).")
    label_key: str | None = arg(None, "Record key passed to the reward function as `labels` (e.g. the answer).")
    input_template: str | None = arg(None, "Template the prompt is put into; '{}' marks where.")
    apply_chat_template: bool = arg(False, "Format prompts with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = arg(None, "A Jinja chat template that replaces the tokenizer's.")
    prompt_max_len: int = arg(1024, "Prompts longer than this many tokens keep their last prompt_max_len tokens.")
    generate_max_len: int = arg(1024, "Most tokens generated per response.")
    packing_samples: bool = arg(False, "Pack the samples of each micro-batch into one row, without padding, for the "
                                       "actor, critic, reference and reward-model forwards (log-probs, values, "
                                       "rewards); samples do not attend to each other.")


@dataclass
class RolloutArgs:
    n_samples_per_prompt: int = arg(1, "Responses sampled per prompt (a group, for the group estimators).")
    rollout_batch_size: int = arg(1024, "Prompts per RL step; the step makes rollout_batch_size x "
                                        "n_samples_per_prompt samples.")
    micro_rollout_batch_size: int = arg(8, "Samples per forward pass when scoring (log-probs, values, rewards).")
    num_episodes: int = arg(1, "Passes over the prompt data.")
    max_epochs: int = arg(1, "Passes over each rollout batch when training on it.")
    max_rl_steps: int = arg(-1, "Stop after this many RL steps (-1: every episode); learning-rate schedules still "
                             "span the whole run, so a later --load_checkpoint continues them.")
    temperature: float = arg(1.0, "Sampling temperature (log-probs for training use the same temperature).")
    top_p: float = arg(1.0, "Nucleus sampling: sample from the smallest token set with this much probability.")
    top_k: int = arg(-1, "Sample from the k most likely tokens (-1: all).")
    eval_temperature: float = arg(0.6, "Sampling temperature of evaluation; 0 decodes greedily.")
    eval_n_samples_per_prompt: int = arg(4, "Responses per held-out prompt (pass@1 is their mean score).")
    vllm_num_engines: int = arg(0, "vLLM rollout engines (train_ppo_ray); 0 uses the Transformers engine.")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine.")
    vllm_gpu_memory_utilization: float = arg(0.9, "Fraction of GPU memory a vLLM engine may take.")
    vllm_sync_backend: str = arg("nccl", "How actor weights reach the vLLM engines.", choices=("nccl", "gloo"))
    vllm_enable_sleep: bool = arg(False, "Put vLLM engines to sleep between rollouts (frees GPU memory).")
    enforce_eager: bool = arg(False, "Disable CUDA graphs in vLLM.")
    enable_prefix_caching: bool = arg(False, "vLLM prefix caching (shares the prompt's KV cache between the n "
                                             "samples of a prompt).")


@dataclass
class AlgorithmArgs:
    advantage_estimator: str = arg("gae", "How advantages are estimated: gae (PPO with a critic), reinforce "
                                          "(REINFORCE++), reinforce_baseline (REINFORCE++-baseline), group_norm "
                                          "(GRPO), dr_grpo (Dr. GRPO), rloo.", choices=ADVANTAGE_ESTIMATORS)
    gamma: float = arg(1.0, "Discount factor.")
    lambd: float = arg(1.0, "GAE lambda.")
    actor_learning_rate: float = arg(1e-6, "Peak learning rate of the actor.")
    critic_learning_rate: float = arg(9e-6, "Peak learning rate of the critic.")
    kl_estimator: str = arg("k1", "Per-token KL estimator (Schulman 2020).", choices=KL_ESTIMATORS)
    use_kl_loss: bool = arg(False, "KL to the reference as a loss term of the actor (GRPO) instead of a reward "
                                   "penalty.")
    init_kl_coef: float = arg(0.01, "KL coefficient (reward penalty, or the KL loss weight with --use_kl_loss); "
                                    "0 with no KL loss skips the reference model.")
    kl_target: float | None = arg(None, "Adapt the KL coefficient towards this KL (Ziegler et al. 2019).")
    kl_horizon: float = arg(10000, "Horizon (in samples) of the adaptive KL controller.")
    eps_clip: float = arg(0.2, "PPO clip range of the ratio.")
    clip_eps_low: float | None = arg(None, "Lower clip range (default: --eps_clip).")
    clip_eps_high: float | None = arg(None, "Upper clip range (default: --eps_clip; larger is DAPO's "
                                            "clip-higher).")
    dual_clip: float | None = arg(None, "Dual-clip constant c > 1 bounding the loss of negative advantages.")
    value_clip: float | None = arg(0.5, "Clip range of the critic's value update (PPO value clipping).")
    entropy_loss_coef: float = arg(0.0, "Weight of the entropy bonus in the actor loss.")
    aux_loss_coef: float = arg(0.0, "Weight of the mixture-of-experts router load-balancing loss in the actor "
                                    "loss (MoE policies only).")
    reward_clip_range: list[float] | None = arg(help="Clip rewards to [low, high] (one value c means [-c, c]).",
                                                factory=lambda: [-10.0, 10.0])
    normalize_reward: bool = arg(False, "Normalise reward-model rewards with the mean/std stored in the reward "
                                        "model's config.")
    no_advantage_std_norm: bool = arg(False, "Centre advantages without dividing by their standard deviation.")
    policy_loss_agg: str = arg("auto", "How the per-token policy loss is reduced over an optimizer step: auto "
                                       "(token_mean; seq_mean_token_sum_norm over --generate_max_len for "
                                       "dr_grpo).", choices=LOSS_AGGREGATIONS)
    policy_loss_type: str = arg("ppo", "Policy loss: ppo (token-level ratio) or gspo (sequence-level ratio of "
                                       "length-normalised log-likelihoods, Zheng et al. 2025).",
                                choices=POLICY_LOSS_TYPES)
    enable_vllm_is_correction: bool = arg(False, "Correct the engine/trainer mismatch: weight the policy loss by "
                                                 "r = p_trainer / p_rollout per token, as --vllm_is_correction_type "
                                                 "says.")
    vllm_is_correction_type: str = arg("tis", "tis: clamp(r, LO, HI) (Yao et al. 2025); icepop: r inside [LO, HI] "
                                              "else 0; seq-mask-tis: r, with a sequence whose geometric-mean r is "
                                              "outside [LO, HI] masked.", choices=IS_CORRECTIONS)
    vllm_is_truncated_threshold: list[float] = arg(help="Bounds LO HI of the importance-sampling correction; one "
                                                        "value is the cap HI with LO = 0.",
                                                   factory=lambda: [2.0])
    freezing_actor_steps: int = arg(-1, "Train only the critic for this many first steps (-1: never frozen).")


@dataclass
class RecipeArgs:
    overlong_buffer_len: int | None = arg(None, "DAPO's soft overlong punishment: responses longer than "
                                                "--generate_max_len minus this many tokens lose reward linearly, "
                                                "up to --overlong_penalty_factor at --generate_max_len.")
    overlong_penalty_factor: float = arg(1.0, "Largest overlong penalty (with --overlong_buffer_len).")
    stop_properly_penalty_coef: float | None = arg(None, "ProRL: rewards of truncated responses (no end of "
                                                         "sequence within --generate_max_len) are multiplied by "
                                                         "this coef if >= 0, replaced by it if < 0.")
    dynamic_filtering: bool = arg(False, "DAPO's dynamic sampling: drop groups whose mean score is outside "
                                         "--dynamic_filtering_reward_range and refill the batch from the next "
                                         "prompts.")
    dynamic_filtering_reward_range: list[float] = arg(help="Open interval LO HI the mean score of a kept group "
                                                           "lies in.", factory=lambda: [0.0, 1.0])
    dynamic_filtering_max_rounds: int = arg(8, "Most generation rounds per step to fill a batch with "
                                               "--dynamic_filtering before the run stops.")


@dataclass
class AsyncArgs:
    async_train: bool = arg(False, "train_ppo_ray: a generator actor generates and scores the next rollout batches "
                                   "into a bounded queue while the actor trains on the previous one (samples are "
                                   "up to --async_queue_size policy versions stale; old log-probs are recomputed "
                                   "by the actor).")
    async_queue_size: int = arg(1, "With --async_train: most rollout batches generated ahead of training, so the "
                                   "most policy versions a trained sample lags the trainer.")
    partial_rollout: bool = arg(False, "With --async_train: weight updates do not wait for in-flight generation; "
                                       "the generator generates in chunks of --partial_rollout_chunk_len tokens and "
                                       "takes a pending update between chunks (a response may mix policy versions; "
                                       "needs --enable_vllm_is_correction).")
    partial_rollout_chunk_len: int = arg(16, "With --partial_rollout: tokens generated per chunk between which a "
                                             "weight update may land.")
    vllm_generate_batch_size: int | None = arg(None, "With --async_train: prompts generated per engine call, a "
                                                     "multiple of --rollout_batch_size above it and at most "
                                                     "--async_queue_size batches (oversampling); the extra batches "
                                                     "are queued for the next steps.")


@dataclass
class ResourceArgs:
    actor_num_nodes: int = arg(1, "Nodes of the actor role (train_ppo_ray).")
    actor_num_gpus_per_node: int = arg(1, "Devices per node of the actor role.")
    critic_num_nodes: int = arg(1, "Nodes of the critic role.")
    critic_num_gpus_per_node: int = arg(1, "Devices per node of the critic role.")
    ref_num_nodes: int = arg(1, "Nodes of the reference role.")
    ref_num_gpus_per_node: int = arg(1, "Devices per node of the reference role.")
    reward_num_nodes: int = arg(1, "Nodes of the reward-model role.")
    reward_num_gpus_per_node: int = arg(1, "Devices per node of the reward-model role.")
    colocate_actor_ref: bool = arg(False, "Put actor and reference on the same devices.")
    colocate_critic_reward: bool = arg(False, "Put critic and reward model on the same devices.")
    colocate_all_models: bool = arg(False, "Put every role and the vLLM engines on the actor's devices "
                                           "(hybrid engine).")
    ref_reward_offload: bool = arg(False, "Keep reference and reward model weights on the CPU between uses.")
    deepspeed_enable_sleep: bool = arg(False, "Offload DeepSpeed states of a role between its calls.")
    ray_call_timeout: float = arg(1800.0, "train_ppo_ray: seconds one call to a role or rollout engine (a training "
                                          "step, a generation, a weight sync) may take before the run stops with "
                                          "a message naming it; a dead actor stops the run at once.")


@dataclass
class RLSaveArgs:
    save_hf_ckpt: bool = arg(False, "Also save the actor as a Hugging Face model inside every checkpoint.")
    save_value_network: bool = arg(False, "Also save the critic to <save_path>_critic at the end.")
    enable_ema: bool = arg(False, "Keep an exponential moving average of the actor's weights; --save_path "
                                  "exports the EMA model, and checkpoints hold it.")
    ema_beta: float = arg(0.992, "EMA decay: ema = beta * ema + (1 - beta) * weights after each optimizer step.")
    best_metric_key: str | None = arg(None, "Also export the policy with the best value of this eval metric "
                                            "(higher is better, e.g. eval/pass@1) to <save_path>/best.")


@dataclass
class PPOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    rl_model: RLModelArgs = field(default_factory=RLModelArgs)
    user_code: UserCodeArgs = field(default_factory=UserCodeArgs)
    agent: AgentArgs = field(default_factory=AgentArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: RLDataArgs = field(default_factory=RLDataArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    algo: AlgorithmArgs = field(default_factory=AlgorithmArgs)
    recipe: RecipeArgs = field(default_factory=RecipeArgs)
    asynchronous: AsyncArgs = field(default_factory=AsyncArgs)
    resources: ResourceArgs = field(default_factory=ResourceArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)
    save: RLSaveArgs = field(default_factory=RLSaveArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        _validate_reward_flags(self)
        _validate_resources(self)  # before the batch arithmetic, which divides by the actor's device count
        _validate_batches(self)
        _validate_algorithm(self)
        _validate_recipe(self)
        _validate_async(self)

    def check_inputs(self) -> None:
        """What the run needs besides valid flags: a policy, prompts, a reward source, the files named (the
        trainers call it before reading anything)."""
        _check_sources(self)


# -- derived settings ---------------------------------------------------------------------------------------
def clip_range(cfg: PPOConfig) -> tuple[float, float]:
    """(clip_eps_low, clip_eps_high), each defaulting to --eps_clip."""
    a = cfg.algo
    return (a.eps_clip if a.clip_eps_low is None else a.clip_eps_low,
            a.eps_clip if a.clip_eps_high is None else a.clip_eps_high)


def needs_reference(cfg: PPOConfig) -> bool:
    """A reference model is needed for a KL penalty or a KL loss."""
    return cfg.algo.init_kl_coef > 0 or cfg.algo.use_kl_loss


def needs_critic(cfg: PPOConfig) -> bool:
    return cfg.algo.advantage_estimator == "gae"


def critic_path(cfg: PPOConfig) -> str | None:
    """The critic's initialisation, OpenRLHF's default: --critic_pretrain, else --reward_pretrain, else --pretrain."""
    return cfg.rl_model.critic_pretrain or cfg.rl_model.reward_pretrain or cfg.model.pretrain


CRITIC_HEAD_HINT = ", or add --critic_init_head to start the critic's head from scratch on purpose"


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


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


# -- validation ---------------------------------------------------------------------------------------------
def _positive(values: dict[str, float]) -> None:
    for flag, value in values.items():
        if value is None or value <= 0:
            raise UserError(f"--{flag} must be positive (got {value})")


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
    check_batch_split(s.train_batch_size, s.micro_train_batch_size, role_ranks(cfg, "actor"), "actor devices")
    if samples % r.micro_rollout_batch_size:
        raise UserError(f"{samples} samples per step (--rollout_batch_size x --n_samples_per_prompt) are not "
                        f"divisible by --micro_rollout_batch_size {r.micro_rollout_batch_size}")
    check_token_budget(s, cfg.data.prompt_max_len + cfg.data.generate_max_len, "--prompt_max_len + --generate_max_len")


def _validate_algorithm(cfg: PPOConfig) -> None:
    a, r = cfg.algo, cfg.rollout
    if a.advantage_estimator in GROUP_BASELINES and r.n_samples_per_prompt < 2:
        raise UserError(f"--advantage_estimator {a.advantage_estimator} compares the samples of one prompt and "
                        f"needs --n_samples_per_prompt > 1 (got {r.n_samples_per_prompt})")
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        raise UserError(f"--dual_clip must be > 1 (got {a.dual_clip})")
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
        low_r, high_r = reward_clip_bounds(cfg)
        if not low_r < high_r:
            raise UserError(f"--reward_clip_range {a.reward_clip_range}: low must be below high")
    _positive({"actor_learning_rate": a.actor_learning_rate})
    if needs_critic(cfg):
        _positive({"critic_learning_rate": a.critic_learning_rate})
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
    if s.enable_ema and cfg.strategy.zero_stage == 3:
        raise UserError("--enable_ema keeps a full copy of the actor's weights and does not work with ZeRO-3's "
                        "partitioned parameters yet; use --zero_stage 2 or drop --enable_ema")
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
    for path in (u for u in remote_reward_urls(cfg) if not is_http(u)):
        p = Path(path).expanduser()
        if p.suffix != ".py" or not p.is_file():
            raise UserError(f"--remote_rm_url {path}: not an http(s) URL and not an existing .py file")


ROLES = ("actor", "critic", "ref", "reward")


def role_needed(cfg: PPOConfig, role: str) -> bool:
    """Whether this run has the role: no critic for a group estimator, no reward model with --remote_rm_url, no
    reference without KL."""
    return {"actor": True, "critic": needs_critic(cfg), "ref": needs_reference(cfg),
            "reward": bool(cfg.rl_model.reward_pretrain)}[role]


def _colocated_host(cfg: PPOConfig, role: str) -> str | None:
    """The role whose devices `role` shares (actor for the hybrid engine and --colocate_actor_ref; critic for
    --colocate_critic_reward), or None."""
    res = cfg.resources
    if role == "actor":
        return None
    if res.colocate_all_models or (role == "ref" and res.colocate_actor_ref):
        return "actor"
    if role == "reward" and res.colocate_critic_reward and role_needed(cfg, "critic"):
        return "critic"
    return None


def role_ranks(cfg: PPOConfig, role: str) -> int:
    """Processes (one device each) of a role: --{role}_num_nodes x --{role}_num_gpus_per_node.

    OpenRLHF's hybrid-engine commands give colocated roles 0 nodes / 0 GPUs ("they live on the actor's devices"):
    a colocated role with 0 devices gets as many ranks as the role it is colocated with."""
    res = cfg.resources
    ranks = getattr(res, f"{role}_num_nodes") * getattr(res, f"{role}_num_gpus_per_node")
    host = _colocated_host(cfg, role)
    if ranks == 0 and host is not None:
        return role_ranks(cfg, host)
    return ranks


def _validate_resources(cfg: PPOConfig) -> None:
    res, r = cfg.resources, cfg.rollout
    if not res.ray_call_timeout > 0:
        raise UserError(f"--ray_call_timeout must be a positive number of seconds (got {res.ray_call_timeout})")
    _positive({"actor_num_nodes": res.actor_num_nodes, "actor_num_gpus_per_node": res.actor_num_gpus_per_node})
    for role in ROLES[1:]:
        nodes, gpus = getattr(res, f"{role}_num_nodes"), getattr(res, f"{role}_num_gpus_per_node")
        flags = f"--{role}_num_nodes {nodes} --{role}_num_gpus_per_node {gpus}"
        if nodes < 0 or gpus < 0:
            raise UserError(f"{flags}: device counts must be >= 0")
        if nodes * gpus == 0 and role_needed(cfg, role) and _colocated_host(cfg, role) is None:
            why = {"critic": "--advantage_estimator gae trains a critic",
                   "ref": "the KL term (--init_kl_coef > 0 or --use_kl_loss) needs the reference model",
                   "reward": "--reward_pretrain names a reward model"}[role]
            raise UserError(f"{flags}: the {role} role has no devices but {why}; give it devices or colocate it "
                            f"with the actor (--colocate_all_models"
                            f"{', --colocate_actor_ref' if role == 'ref' else ''}"
                            f"{', --colocate_critic_reward' if role == 'reward' else ''})")
    if r.vllm_num_engines < 0:
        raise UserError(f"--vllm_num_engines must be >= 0 (got {r.vllm_num_engines})")
    _positive({"vllm_tensor_parallel_size": r.vllm_tensor_parallel_size})
    if not 0 < r.vllm_gpu_memory_utilization <= 1:
        raise UserError(f"--vllm_gpu_memory_utilization must be in (0, 1] (got {r.vllm_gpu_memory_utilization})")
    if res.colocate_all_models and r.vllm_num_engines > 0:
        actor = res.actor_num_nodes * res.actor_num_gpus_per_node
        engines = r.vllm_num_engines * r.vllm_tensor_parallel_size
        if actor != engines:
            raise UserError(f"--colocate_all_models needs actor devices (--actor_num_nodes x "
                            f"--actor_num_gpus_per_node = {actor}) == --vllm_num_engines x "
                            f"--vllm_tensor_parallel_size (= {engines})")


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
        if cfg.agent.agent_func_path:
            raise UserError("--partial_rollout with --agent_func_path is not supported yet (agent episodes run "
                            "inside the engines; weight updates wait for them); drop --partial_rollout")
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
    """What only train_ppo_ray runs: asynchronous training needs the generator as its own Ray actor."""
    if cfg.asynchronous.async_train:
        raise UserError("--async_train needs a generator actor beside the trainer: run it with "
                        "python -m rlhfkit.cli.train_ppo_ray")

