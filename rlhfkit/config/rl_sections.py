"""The flag sections of the RL config (`rlhfkit.config.rl.PPOConfig`): each a dataclass of OpenRLHF-named flags
with their help text and defaults, and the rules that concern one section alone (`validate`). The rules across
sections, and the settings the flags imply, live with `PPOConfig` in `rlhfkit.config.rl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfkit.config.base import arg, with_default
from rlhfkit.config.common import StrategyArgs
from rlhfkit.config.names import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
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
                                          "queries, prompts, labels), comma-separated HTTP reward servers "
                                          "(http://host:port/get_reward), or `reasoning_gym` (the scorer of "
                                          "--prompt_data reasoning_gym:<task>).")
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
    reward_timeout: float = arg(60.0, "Seconds one reward function call (or agent reset/step/run_agent, an "
                                      "agent's blocking execute, importing the agent file in a worker before "
                                      "training) may take; a slower "
                                      "call is killed (its worker replaced; an agent's episode ends), and a reward "
                                      "call is retried in halves, so a sample that hangs costs at most 1 + "
                                      "log2(--micro_rollout_batch_size) timeouts per step.")
    reward_fallback: float = arg(0.0, "Reward (and score) of a sample that failed alone in the reward function "
                                      "(a failed call is retried in halves first): it raised, timed out, crashed, "
                                      "or returned NaN/inf, the wrong type or the wrong number of values (or whose "
                                      "agent episode failed).")
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


TOOL_FORMATS = ("hermes", "llama3", "mistral")  # rlhfkit.agents.tool_parsers.FORMATS (a test keeps them equal)


@dataclass
class AgentArgs:
    agent_func_path: str | None = arg(None, "Multi-turn agent file defining AgentExecutor and AgentInstance "
                                            "(import their bases from rlhfkit.agents); its step rewards are the "
                                            "reward, so no --remote_rm_url / --reward_pretrain.")
    max_steps: int | None = arg(None, "Turns per agent episode (with --agent_func_path; default: until done or "
                                      "--generate_max_len tokens). The RL-step cap is --max_rl_steps.")
    tool_format: str | None = arg(None, "Tool-call format of a tool agent (rlhfkit.agents.ToolAgent): hermes "
                                        "(<tool_call>{json}</tool_call>, Hermes/Qwen), llama3 (JSON after "
                                        "<|python_tag|> or bare) or mistral ([TOOL_CALLS][...]). Default: detected "
                                        "from the markers of the tokenizer's chat template.",
                                  choices=TOOL_FORMATS)


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
class RLStrategyArgs(StrategyArgs):
    """OpenRLHF 0.11's train_ppo_ray trains on one sample per micro-batch unless told otherwise."""

    micro_train_batch_size: int = with_default(StrategyArgs, "micro_train_batch_size", 1)


@dataclass
class RolloutArgs:
    n_samples_per_prompt: int = arg(1, "Responses sampled per prompt (a group, for the group estimators).")
    rollout_batch_size: int = arg(1024, "Prompts per RL step; the step makes rollout_batch_size x "
                                        "n_samples_per_prompt samples.")
    micro_rollout_batch_size: int = arg(1, "Samples per forward pass when scoring (log-probs, values, rewards).")
    rollout_max_tokens_per_gpu: int | None = arg(None, "With --use_dynamic_batch: the token budget of one scoring "
                                                       "forward (old log-probs, reference log-probs, values, "
                                                       "rewards; no backward, so it may exceed the training one); "
                                                       "default: --max_tokens_per_gpu.")
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
    vllm_gpu_memory_utilization: float = arg(0.95, "Fraction of GPU memory a vLLM engine may take.")
    vllm_sync_backend: str = arg("nccl", "How actor weights reach the vLLM engines.", choices=("nccl", "gloo"))
    vllm_enable_sleep: bool = arg(False, "Put vLLM engines to sleep between rollouts (frees GPU memory).")
    lora_sync: str = arg("auto", "With --lora_rank, what a weight sync sends the rollout engines: adapter (the LoRA "
                                 "adapter only, into the engines' adapter slot over the unchanged base model), merged "
                                 "(the adapter merged into full weights, as OpenRLHF does), or auto (adapter where "
                                 "the engine can hold the adapter: always on the Transformers engine, on vLLM up to "
                                 "rank 512; else merged, said once at start). OpenRLHF has no such flag.",
                          choices=("auto", "adapter", "merged"))
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
    policy_loss_type: str = arg("ppo", "Policy loss: ppo (token-level ratio); gspo (sequence-level ratio of "
                                       "length-normalised log-likelihoods, Zheng et al. 2025); cispo (MiniMax-M1, "
                                       "2025: -sg(clip(ratio)) * A * log p on every token, the ratio clipped by "
                                       "--clip_eps_low / --clip_eps_high as veRL does; the paper drops the lower "
                                       "bound: --clip_eps_low 1); sapo (Gao et al. 2025: a sigmoid gate of "
                                       "temperature --tau_pos / --tau_neg instead of the clip).",
                                choices=POLICY_LOSS_TYPES)
    tau_pos: float = arg(1.0, "SAPO's gate temperature for positive advantages (veRL's name and the paper's "
                              "default); larger fades off-policy updates faster.")
    tau_neg: float = arg(1.05, "SAPO's gate temperature for negative advantages (veRL's name and the paper's "
                               "default; > --tau_pos damps negative updates more).")
    enable_vllm_is_correction: bool = arg(False, "Correct the engine/trainer mismatch: weight the policy loss by "
                                                 "r = p_trainer / p_rollout per token, as --vllm_is_correction_type "
                                                 "says.")
    vllm_is_correction_type: str = arg("tis", "tis: clamp(r, LO, HI) (Yao et al. 2025); icepop: r inside [LO, HI] "
                                              "else 0; seq-mask-tis: r, with a sequence whose geometric-mean r is "
                                              "outside [LO, HI] masked.", choices=IS_CORRECTIONS)
    vllm_is_truncated_threshold: list[float] = arg(help="Bounds LO HI of the importance-sampling correction; one "
                                                        "value is the cap HI with LO = 0.",
                                                   factory=lambda: [0.5, 5.0])
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
                                       "needs --enable_vllm_is_correction). Agent episodes (--agent_func_path) run "
                                       "in the generator and continue across an update with the new weights, "
                                       "between their turns and inside them; every token records its version.")
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
    teacher_num_nodes: int = arg(1, "Nodes of the distillation teacher role (--teacher_pretrain).")
    teacher_num_gpus_per_node: int = arg(1, "Devices per node of the distillation teacher role.")
    colocate_actor_ref: bool = arg(False, "Put actor and reference (and a distillation teacher) on the same "
                                          "devices.")
    colocate_critic_reward: bool = arg(False, "Put critic and reward model on the same devices.")
    colocate_all_models: bool = arg(False, "Put every role and the vLLM engines on the actor's devices "
                                           "(hybrid engine).")
    ref_reward_offload: bool = arg(False, "Keep reference, reward model and teacher weights on the CPU between "
                                          "uses.")
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
class DoctorArgs:
    """The RL run doctor's switch and thresholds (rlhfkit/logging/doctor.py; docs/doctor.md lists each alarm)."""

    doctor: str = arg("on", "In-run alarms with one line of advice each (console, metrics.jsonl `doctor/...` "
                            "records, the run report): entropy collapse, KL blow-up, clip fraction out of range, "
                            "response length running away or collapsing, all-equal reward groups, rollout/trainer "
                            "log-prob gap, reward hacking. off: none.", choices=("on", "off"))
    doctor_window: int = arg(5, "RL steps in the doctor's moving averages; each alarm compares the mean of the "
                                "last this many steps with its threshold.")
    doctor_entropy_ratio: float = arg(0.2, "Entropy collapse: the actor's mean token entropy fell below this "
                                           "fraction of its value at the first step.")
    doctor_kl_max: float = arg(1.0, "KL blow-up: the mean per-token KL to the reference (train/kl, nats) is "
                                    "above this.")
    doctor_clip_fraction_range: list[float] = arg(help="Clip fraction out of range: the share of clipped tokens "
                                                       "(train/actor/clip_fraction) is outside LO HI (LO 0 never "
                                                       "fires: one optimizer step per rollout clips nothing).",
                                                  factory=lambda: [0.0, 0.3])
    doctor_length_range: list[float] = arg(help="Response length collapsing or running away: the mean response "
                                                "length is outside LO HI times its value at the first step.",
                                           factory=lambda: [0.25, 3.0])
    doctor_truncated_max: float = arg(0.5, "Response length running away into the cap: the share of responses cut "
                                           "at --generate_max_len (train/truncated) rose above this from a start "
                                           "at or below it.")
    doctor_equal_reward_groups_max: float = arg(0.8, "All-equal reward groups: the share of prompts whose "
                                                     "--n_samples_per_prompt samples all got the same reward (no "
                                                     "group advantage, nothing learned) is above this.")
    doctor_logprob_gap_max: float = arg(0.1, "Rollout/trainer log-prob gap: the mean absolute per-token gap "
                                             "between the rollout engine's and the trainer's log-probs "
                                             "(train/rollout_logprob_diff) is above this.")
    doctor_heldout_drop: float = arg(0.05, "Reward hacking hint: the held-out eval/pass@1 fell this much below "
                                           "its best evaluation while the training reward rose above its level "
                                           "then (needs --eval_dataset).")

    def validate(self) -> None:
        if self.doctor_window < 1:
            raise UserError(f"--doctor_window must be >= 1 (got {self.doctor_window})")
        for flag in ("doctor_entropy_ratio", "doctor_truncated_max", "doctor_equal_reward_groups_max"):
            if not 0 <= getattr(self, flag) <= 1:
                raise UserError(f"--{flag} must be in [0, 1] (got {getattr(self, flag)})")
        for flag in ("doctor_kl_max", "doctor_logprob_gap_max", "doctor_heldout_drop"):
            if not getattr(self, flag) > 0:
                raise UserError(f"--{flag} must be > 0 (got {getattr(self, flag)})")
        for flag in ("doctor_clip_fraction_range", "doctor_length_range"):
            values = getattr(self, flag)
            if len(values) != 2 or not 0 <= values[0] < values[1]:
                raise UserError(f"--{flag} takes LO HI with 0 <= LO < HI (got {values})")
