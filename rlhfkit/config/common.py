"""Config sections shared by every trainer: model, strategy, data, logging, checkpoints.

Field names are the flags users already type for OpenRLHF (`--pretrain`, `--zero_stage`, ...). Each section's
`validate()` holds the rules of its own flags; a config's `validate()` runs them (`validate_sections`) and adds the
rules that join sections (`check_token_budget`, `check_aux_loss_flags`). `check_batch_split` is the one batch
arithmetic rule, used at parse time and again wherever the rank count is only known later (the launcher's world
size, each Ray role's ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfkit.config.base import arg
from rlhfkit.config.devices import ATTN_CHOICES, ATTN_HELP, AUTO, BF16_HELP, check_gpu_only
from rlhfkit.config.sequence_parallel import check_ring_flags
from rlhfkit.errors import UserError

OPTIMIZERS = ("adam", "muon")
LR_SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant_with_warmup", "constant")


def _need(ok: bool, flag: str, value: object, rule: str) -> None:
    """A numeric flag outside its range is a user error named with its value and the allowed range."""
    if not ok:
        raise UserError(f"--{flag} {value}: must be {rule}")


@dataclass
class ModelArgs:
    pretrain: str | None = arg(None, "Model to train: a local Hugging Face model directory, a GGUF file "
                                     "(`model.gguf`: converted once to a Hugging Face directory in the cache, see "
                                     "Real models in the docs), or a hub name (fetched only when you name one and "
                                     "the hub is reachable).")
    gguf_file: str | None = arg(None, "The GGUF file inside the --pretrain directory to load (e.g. "
                                      "model-q4_k_m.gguf); the same as --pretrain DIR/NAME.")
    bf16: bool = arg(False, BF16_HELP)
    attn_implementation: str = arg(AUTO, ATTN_HELP, choices=ATTN_CHOICES)
    flash_attn: bool = arg(False, "Use flash_attention_2 (the same as --attn_implementation flash_attention_2).")
    gradient_checkpointing: bool = arg(False, "Recompute activations in the backward pass to save memory.")
    gradient_checkpointing_use_reentrant: bool = arg(False, "With --gradient_checkpointing, use torch's reentrant "
                                                            "checkpoint variant (default: non-reentrant); same "
                                                            "gradients, different autograd mechanics.")
    disable_fast_tokenizer: bool = arg(False, "Load the slow (Python) tokenizer.")
    lora_rank: int = arg(0, "LoRA rank; 0 trains all weights.")
    lora_alpha: int = arg(16, "LoRA alpha (scale = alpha / rank).")
    lora_dropout: float = arg(0.0, "Dropout on the LoRA branch.")
    target_modules: list[str] | None = arg(None, "Module names LoRA adapts (default: every linear layer).")
    load_in_4bit: bool = arg(False, "QLoRA: load the trained model's base weights in 4-bit NF4 and train LoRA "
                                    "adapters on them (needs --lora_rank, a CUDA GPU and bitsandbytes; causal-LM "
                                    "trainers and the RL actor).")
    use_liger_kernel: bool = arg(False, "Patch the trained causal LM (SFT, DPO and KTO policy, the RL actor) with "
                                        "the Liger Triton kernels (fused RMSNorm, RoPE, SwiGLU, cross-entropy); "
                                        "frozen, reward and critic models keep Transformers' kernels. Needs a CUDA "
                                        "GPU and the liger_kernel package (pip install liger-kernel); on CPU it "
                                        "stops with the reason.")

    def validate(self) -> None:
        """Out-of-range numbers fail at parse time, before any model loads."""
        if self.use_liger_kernel:
            check_gpu_only("use_liger_kernel", "Liger's kernels are Triton GPU kernels", package="liger_kernel")
        _need(self.lora_rank >= 0, "lora_rank", self.lora_rank, "0 (train all weights) or a positive rank")
        _need(self.lora_rank == 0 or self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "positive")
        _need(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "in [0, 1)")
        if self.flash_attn and self.attn_implementation == "eager":
            raise UserError("--flash_attn asks for flash_attention_2 but --attn_implementation is eager; pass one")


@dataclass
class StrategyArgs:
    backend: str = arg("deepspeed", "Training backend: deepspeed (ZeRO, --zero_stage) or fsdp2 (PyTorch "
                                    "fully_shard: parameters, gradients and AdamW state sharded over all ranks, "
                                    "checkpoints through torch.distributed.checkpoint that resume at another "
                                    "world size). With fsdp2, --bf16 computes in bf16 over fp32 shards and "
                                    "--adam_offload keeps shards and optimizer state in CPU memory; every trainer "
                                    "and RL role (actor, critic, reference, reward; not a LoRA RL actor).",
                       choices=("deepspeed", "fsdp2"))
    zero_stage: int = arg(2, "DeepSpeed ZeRO stage.", choices=(0, 1, 2, 3))
    ds_tensor_parallel_size: int = arg(1, "Tensor parallel size (OpenRLHF's flag): each decoder layer's attention "
                                          "and MLP projections split over this many ranks (torch tensor parallel, "
                                          "column- then row-wise) and FSDP2 shards over the rest (world size / "
                                          "this). Needs --backend fsdp2 (DeepSpeed AutoTP is not wired yet); SFT, RM, "
                                          "DPO and KTO only. Must divide the world size, the attention and KV "
                                          "heads and the MLP intermediate size.")
    adam_offload: bool = arg(False, "Keep optimizer states on the CPU (DeepSpeed CPU Adam).")
    train_batch_size: int = arg(128, "Global training batch size (samples per optimizer step, all ranks).")
    micro_train_batch_size: int = arg(8, "Samples per forward/backward on one rank; gradient accumulation "
                                         "= train_batch_size / (micro_train_batch_size x world size).")
    max_norm: float = arg(1.0, "Gradient clipping norm.")
    learning_rate: float = arg(5e-6, "Peak learning rate.")
    lr_warmup_ratio: float = arg(0.03, "Fraction of the optimizer steps spent warming the learning rate up.")
    lr_scheduler: str = arg("cosine_with_min_lr", "Learning-rate schedule after warmup (cosine_with_min_lr ends at "
                            "--min_lr_ratio x the peak).", choices=LR_SCHEDULERS)
    min_lr_ratio: float = arg(0.1, "Floor of the cosine_with_min_lr schedule, as a fraction of the peak learning "
                                   "rate (of each parameter group).")
    optim: str = arg("adam", "Optimizer: adam (AdamW), or muon: torch's Muon (Jordan et al. 2024) for the hidden "
                             "layers' weight matrices at --muon_lr, AdamW at the learning rate for the rest "
                             "(embeddings, LM head, value heads, norms, biases). Needs fp32 weights and no "
                             "--adam_offload; over several processes --zero_stage 0 (one process: below 3).",
                     choices=OPTIMIZERS)
    l2: float = arg(0.0, "Weight decay of AdamW (and of Muon with --optim muon; biases and norms get none).")
    adam_betas: list[float] = arg(help="AdamW betas.", factory=lambda: [0.9, 0.95])
    adam_eps: float = arg(1e-8, "AdamW's eps (added to the root of the second moment).")
    muon_lr: float = arg(0.02, "With --optim muon: peak learning rate of the Muon group (scaled by sqrt(max(1, "
                               "rows / cols)) per matrix; the schedule applies to it as to the AdamW group).")
    muon_momentum: float = arg(0.95, "With --optim muon: Muon's momentum.")
    muon_ns_steps: int = arg(5, "With --optim muon: Newton-Schulz iterations that orthogonalise each update.")
    muon_nesterov: bool = arg(True, "With --optim muon: Nesterov momentum (--no-muon_nesterov: plain momentum).")
    seed: int = arg(42, "Random seed (model init, data order, sampling).")
    full_determinism: bool = arg(False, "Two runs with the same seed, flags and layout give bit-identical weights: "
                                        "deterministic torch algorithms (CUBLAS_WORKSPACE_CONFIG on GPU), every "
                                        "generator seeded, and on CPU one thread per training and engine process "
                                        "(whatever OMP_NUM_THREADS says) so every sum is added in one fixed order. "
                                        "On GPU some parts stay non-deterministic (listed at start and in "
                                        "docs/troubleshooting.md).")
    deepcompile: bool = arg(False, "DeepSpeed's deepcompile (compiler passes over the ZeRO engine; the engine's "
                                   "compile() is called after initialize). Needs a CUDA GPU; on CPU it stops with "
                                   "the reason.")
    local_rank: int = arg(-1, "Set by the deepspeed launcher; leave unset.")
    zpg: int = arg(1, "ZeRO++ hierarchical partition size (1 = off).")
    overlap_comm: bool = arg(False, "Overlap gradient reduction with backward (DeepSpeed overlap_comm).")
    grad_accum_dtype: str | None = arg(None, "Gradient accumulation dtype (fp32 or bf16); default follows DeepSpeed.")
    use_dynamic_batch: bool = arg(False, "Cut each optimizer step's samples into micro-batches by token count "
                                         "(--max_tokens_per_gpu) instead of --micro_train_batch_size samples (RL "
                                         "scoring: instead of --micro_rollout_batch_size); the step's samples and "
                                         "its gradient stay the same. Not in train_kto.")
    max_tokens_per_gpu: int | None = arg(None, "Token budget of one forward/backward on one device with "
                                               "--use_dynamic_batch (packed: the samples' tokens; padded: rows x "
                                               "the longest row).")
    ddp_timeout: float = arg(1800.0, "Seconds a torch.distributed collective (and the start-up rendezvous) of the "
                                     "training ranks waits for its peers (gloo and NCCL); past it, a rank whose "
                                     "peer died or hangs stops the run with an error naming this flag.")
    max_nonfinite_steps: int = arg(10, "Stop the run (exit 2) after this many optimizer steps in a row whose loss "
                                       "or gradient was NaN/inf; each such update is skipped on every rank (weights "
                                       "unchanged) and counted in the metrics as nonfinite_skipped.")
    ring_attn_size: int = arg(1, "Sequence parallelism (OpenRLHF's flag name): this many ranks share each sample, "
                                 "each holding a contiguous slice of its tokens; attention exchanges heads with one "
                                 "all-to-all per layer (DeepSpeed-Ulysses, exact; gloo or NCCL). The data-parallel "
                                 "world is world size / this; it must divide the world size and the model's "
                                 "attention heads (in train_ppo_ray: every role's devices). train_sft, train_rm, "
                                 "train_dpo and the RL trainers' actor, critic, reference and reward forwards "
                                 "(padded and packed samples), DeepSpeed or --backend fsdp2; rollout engines "
                                 "generate as before.")
    ring_head_stride: int = arg(1, "OpenRLHF's ring-flash-attn head stride (heads per ring step); accepted for "
                                   "OpenRLHF's commands and without effect: rlhfkit's sequence parallelism is "
                                   "Ulysses, one all-to-all of whole heads, with no ring.")

    def validate(self) -> None:
        """Out-of-range numbers fail at parse time, before any model loads (NaN fails every `ok` test)."""
        lr = self.learning_rate
        _need(math.isfinite(lr) and lr > 0, "learning_rate", lr, "a positive finite number, e.g. 5e-6")
        check_optimizer_flags(self)
        if self.deepcompile:
            check_gpu_only("deepcompile", "DeepSpeed compiles for CUDA devices")
        _need(self.zpg >= 1, "zpg", self.zpg, "at least 1 (1 = off)")
        _need(math.isfinite(self.ddp_timeout) and self.ddp_timeout > 0, "ddp_timeout", self.ddp_timeout,
              "a positive number of seconds (default 1800)")
        _need(self.max_nonfinite_steps >= 1, "max_nonfinite_steps", self.max_nonfinite_steps, "at least 1")
        # the part of the batch split known before launch; the world size / each role's ranks are checked later
        check_batch_split(self.train_batch_size, self.micro_train_batch_size, 1)
        if not self.use_dynamic_batch and self.max_tokens_per_gpu is not None:
            raise UserError("--max_tokens_per_gpu only applies with --use_dynamic_batch; add that flag or drop it")
        if self.use_dynamic_batch and self.max_tokens_per_gpu is None:
            raise UserError("--use_dynamic_batch needs --max_tokens_per_gpu N: the tokens of one micro-batch per "
                            "device")
        check_ring_flags(self.ring_attn_size, self.ring_head_stride)
        if self.max_tokens_per_gpu is not None:
            _need(self.max_tokens_per_gpu >= 1, "max_tokens_per_gpu", self.max_tokens_per_gpu, "at least 1 token")


@dataclass
class LoggingArgs:
    logging_steps: int = arg(1, "Log metrics every N optimizer steps.")
    eval_steps: int = arg(-1, "Evaluate every N optimizer steps; -1 evaluates once at the end of each epoch.")
    use_wandb: str | None = arg(None, "Log to Weights & Biases: an API key, or 'offline' / 'true' to use the "
                                      "environment's login (WANDB_MODE=offline works without a network).")
    wandb_org: str | None = arg(None, "W&B entity.")
    wandb_group: str | None = arg(None, "W&B group.")
    wandb_project: str = arg("rlhfkit", "W&B project.")
    wandb_run_name: str | None = arg(None, "W&B run name (default: the trainer name and a timestamp).")
    use_tensorboard: str | None = arg(None, "Write TensorBoard event files under this directory.")
    metrics_path: str | None = arg(None, "JSONL metrics file (default: <save_path>/metrics.jsonl).")
    disable_progress_bar: bool = arg(False, "No console progress bar (metrics still go to the JSONL file).")

    def validate(self) -> None:
        _need(self.logging_steps >= 1, "logging_steps", self.logging_steps, "at least 1")
        _need(self.eval_steps == -1 or self.eval_steps >= 1, "eval_steps", self.eval_steps,
              "-1 (end of each epoch) or at least 1")


@dataclass
class CheckpointArgs:
    save_path: str = arg("./ckpt", "Where the final Hugging Face model and tokenizer are saved.")
    save_steps: int = arg(-1, "Save a resumable checkpoint every N optimizer steps (-1: never).")
    ckpt_path: str = arg("./ckpt/checkpoints", "Directory of the resumable checkpoints.")
    max_ckpt_num: int = arg(3, "Keep at most this many resumable checkpoints (oldest removed first).")
    max_ckpt_mem: float = arg(1e8, "Keep the resumable checkpoints under this total size in GB (OpenRLHF's unit), "
                                   "removing the oldest first; the newest is always kept.")
    load_checkpoint: bool = arg(False, "Resume from the newest complete checkpoint in --ckpt_path if there is one "
                                       "(it must come from the same trainer, model and batch size).")
    overwrite_ckpt: bool = arg(False, "Delete the checkpoints of an earlier run found in --ckpt_path at the start "
                                      "(without it, or --load_checkpoint, such a --ckpt_path is an error).")
    use_ds_universal_ckpt: bool = arg(False, "Save checkpoints in a layout-free form (each rank writes its part of "
                                             "the fp32 weights and Adam states, by parameter name and element "
                                             "range; no rank gathers the model) that resumes at any ZeRO stage, "
                                             "precision and world size; without it they resume at the same stage "
                                             "and world size only.")

    def validate(self) -> None:
        _need(self.save_steps == -1 or self.save_steps >= 1, "save_steps", self.save_steps,
              "-1 (no resumable checkpoints) or at least 1")
        _need(self.max_ckpt_num >= 1, "max_ckpt_num", self.max_ckpt_num, "at least 1")
        _need(self.max_ckpt_mem > 0, "max_ckpt_mem", self.max_ckpt_mem, "a positive size in GB")


@dataclass
class DataArgs:
    dataset: str | None = arg(None, "Training data: comma-separated local files (json, jsonl, parquet, csv, "
                                    "arrow), saved `datasets` directories, or hub names. Append @split to "
                                    "pick a split (data.jsonl@train).")
    dataset_probs: str | None = arg(None, "Mixing probabilities for several datasets, e.g. 0.3,0.7.")
    dataset_split: str = arg("train", "Split to read from datasets that have splits.")
    eval_dataset: str | None = arg(None, "Evaluation data, in the same forms as --dataset.")
    eval_split: str = arg("train", "Split of --eval_dataset to read.")
    max_samples: int = arg(10**6, "Use at most this many training samples.")
    max_len: int = arg(2048, "Truncate each tokenised sample to this many tokens.")
    input_key: str = arg("input", "Record key of the prompt (or of the message list with --multiturn).")
    output_key: str | None = arg(None, "Record key of the response.")
    input_template: str | None = arg(None, "Template a plain-text prompt is put into; '{}' marks where, e.g. "
                                           "$'User: {}\\nAssistant: ' ('' for none). Not used with "
                                           "--apply_chat_template or --pretrain_mode.")
    apply_chat_template: bool = arg(False, "Format with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = arg(None, "A Jinja chat template that replaces the tokenizer's.")
    multiturn: bool = arg(False, "Records are whole conversations; loss on every assistant turn.")
    pretrain_mode: bool = arg(False, "Loss on every token (continued pretraining), not only the response.")
    packing_samples: bool = arg(False, "Pack samples into one row; they do not attend to each other.")

    def validate(self) -> None:
        _need(self.max_len >= 2, "max_len", self.max_len, "at least 2 tokens (a token and the one it predicts)")
        _need(self.max_samples >= 1, "max_samples", self.max_samples, "at least 1")


@dataclass
class DryRunArgs:
    dry_run: bool = arg(False, "Print the memory plan (per device and role: weights, gradients, optimizer states, "
                               "activations, KV cache) with a verdict and advice, then exit 0 without loading a "
                               "model or training; reads only the models' config.json.")
    dry_run_gpu_memory_gb: float | None = arg(None, "With --dry_run: plan for GPUs of this many GB (GiB) each, e.g. "
                                                    "80, from any machine (default: the local GPUs, else the host's "
                                                    "memory for a CPU run).")
    dry_run_num_gpus: int | None = arg(None, "With --dry_run: data-parallel GPUs of train_sft/rm/dpo/kto (default: "
                                             "the launcher's WORLD_SIZE, else 1); train_ppo_ray takes its devices "
                                             "from the --*_num_nodes / --*_num_gpus_per_node flags.")

    def validate(self) -> None:
        gb, n = self.dry_run_gpu_memory_gb, self.dry_run_num_gpus
        _need(gb is None or (math.isfinite(gb) and gb > 0), "dry_run_gpu_memory_gb", gb, "a positive size in GB")
        _need(n is None or n >= 1, "dry_run_num_gpus", n, "at least 1")
        if not self.dry_run and (gb is not None or n is not None):
            raise UserError("--dry_run_gpu_memory_gb / --dry_run_num_gpus only apply with --dry_run; add it")


def check_optimizer_flags(s: StrategyArgs, prefix: str = "") -> None:
    """The optimizer and schedule flags' rules, for the flags `--{prefix}max_norm`, ... (the critic's: prefix
    critic_, checked on the critic's settings)."""
    _need(math.isfinite(s.max_norm) and s.max_norm >= 0, prefix + "max_norm", s.max_norm,
          "a finite number >= 0 (0 turns clipping off)")
    _need(math.isfinite(s.l2) and s.l2 >= 0, prefix + "l2", s.l2, "a finite weight decay >= 0")
    _need(0 <= s.lr_warmup_ratio <= 1, prefix + "lr_warmup_ratio", s.lr_warmup_ratio, "in [0, 1]")
    _need(0 <= s.min_lr_ratio <= 1, prefix + "min_lr_ratio", s.min_lr_ratio, "in [0, 1]")
    if s.min_lr_ratio != 0.1 and s.lr_scheduler != "cosine_with_min_lr":
        raise UserError(f"--{prefix}min_lr_ratio only applies to --{prefix}lr_scheduler cosine_with_min_lr (got "
                        f"{s.lr_scheduler}); drop it or pick that schedule")
    betas = " ".join(map(str, s.adam_betas))
    _need(len(s.adam_betas) == 2, prefix + "adam_betas", betas, "two numbers, e.g. --adam_betas 0.9 0.95")
    _need(all(0 <= b < 1 for b in s.adam_betas), prefix + "adam_betas", betas, "two numbers in [0, 1)")
    _need(math.isfinite(s.adam_eps) and s.adam_eps > 0, prefix + "adam_eps", s.adam_eps, "a positive number")
    _need(math.isfinite(s.muon_lr) and s.muon_lr > 0, prefix + "muon_lr", s.muon_lr, "a positive finite number")
    _need(0 <= s.muon_momentum < 1, prefix + "muon_momentum", s.muon_momentum, "in [0, 1)")
    _need(1 <= s.muon_ns_steps < 100, prefix + "muon_ns_steps", s.muon_ns_steps, "in [1, 99] (torch's limit)")


def check_batch_split(train_batch_size: int, micro_batch_size: int, ranks: int, ranks_name: str = "world size") -> int:
    """Gradient-accumulation steps per rank, train_batch_size / (micro_batch_size x ranks); a UserError when the
    global batch does not split evenly over `ranks` processes (`ranks_name` says where that count comes from)."""
    if train_batch_size < 1 or micro_batch_size < 1:
        raise UserError(f"--train_batch_size and --micro_train_batch_size must be positive (got {train_batch_size}, "
                        f"{micro_batch_size})")
    per_step = micro_batch_size * ranks
    if train_batch_size % per_step:
        raise UserError(f"--train_batch_size {train_batch_size} is not divisible by --micro_train_batch_size "
                        f"{micro_batch_size} x {ranks_name} {ranks} = {per_step}; pick a multiple of {per_step}")
    return train_batch_size // per_step


def check_token_budget(strategy: StrategyArgs, longest: int, longest_flags: str) -> None:
    """--max_tokens_per_gpu (with --use_dynamic_batch) must hold the longest possible sample (`longest` tokens, set
    by `longest_flags`); the pairing of the two flags is StrategyArgs.validate's."""
    budget = strategy.max_tokens_per_gpu
    if strategy.use_dynamic_batch and budget is not None and budget < longest:
        raise UserError(f"--max_tokens_per_gpu {budget} is smaller than the longest possible sample ({longest} "
                        f"tokens: {longest_flags}); raise it to at least {longest}")


def check_aux_loss_flags(coef: float, packing: bool) -> None:
    """--aux_loss_coef's flag rules (whether the model has experts is checked when it is known,
    `rlhfkit.models.moe.check_aux_loss_coef`): >= 0, and not with packed batches (Transformers' router loss reads
    a 2-D attention mask; packed rows carry a 4-D block mask)."""
    _need(coef >= 0, "aux_loss_coef", coef, ">= 0")
    if coef > 0 and packing:
        raise UserError("--aux_loss_coef with --packing_samples is not supported: the router load-balancing loss "
                        "needs padded batches (a 2-D attention mask); drop one of the two flags")


def check_loop_counts(max_epochs: int, max_steps: int) -> None:
    """An offline trainer's --max_epochs / --max_steps must train something (and still save a model after)."""
    if max_epochs < 1:
        raise UserError(f"--max_epochs {max_epochs}: a run needs at least one epoch (1 or more)")
    if max_steps == 0:
        raise UserError(f"--max_steps {max_steps} trains nothing: use -1 (every epoch) or a positive number of steps")
