"""`run_batch_inference(cfg)`: generate over a dataset, score the samples, write them (or training data made from
them) as JSONL.

The pieces are the RL run's: prompts are formatted like `PromptDataset` and tokenised like the RL loop (bos +
prompt, the last --prompt_max_len tokens); samples come from the Transformers engine or vLLM, in this process
(--num_engines 1) or from engine actors on Ray that split each chunk of prompts (`RolloutEngineGroup`); rewards
come from a reward model (`RewardScorer`, the text scorer of serve_rm), a reward function file or HTTP reward
servers (`rewards/sources.py`); `data/post_processors.py` turns scored samples into SFT, conditional-SFT or DPO
data. Reward queries are prompt text + response text with its special tokens (what the RL loop sends); written
outputs drop special tokens, so a trainer that reads them adds its own eos.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from rlhfkit.config.base import required
from rlhfkit.config.batch_inference import BatchInferenceConfig, engine_spec, reward_model_path
from rlhfkit.errors import UserError

if TYPE_CHECKING:
    from rlhfkit.distributed.placement import ResourcePlan


def write_jsonl_atomic(path: str, records: Iterable[Mapping[str, Any]]) -> int:
    """Write records as JSON lines to a temporary file next to `path`, then rename it into place (a crash or an
    error never leaves a half-written output). Returns the number of records."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UserError(f"--output_path {path} is a directory; give a file name such as {path}/out.jsonl")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


@dataclass
class Prompt:
    """One prompt to generate for: the record's input (as written out), its formatted text, ids and label."""

    input: Any
    text: str
    ids: list[int]
    label: Any = None
    images: dict[str, torch.Tensor] | None = None  # --image_key: {"pixel_values", "image_grid_thw"}


def load_records(cfg: BatchInferenceConfig) -> list[Any]:
    from rlhfkit.data.readers import load_mixture

    d = cfg.data
    records = load_mixture(required(d.dataset, "dataset"), d.dataset_probs, d.dataset_split, d.max_samples,
                           cfg.model.seed)
    if d.iter is not None:
        start = d.iter * d.rollout_batch_size
        if start >= len(records):
            raise UserError(f"--iter {d.iter}: the dataset has {len(records)} records, none from record {start} "
                            f"on (--iter x --rollout_batch_size {d.rollout_batch_size})")
        records = records[start:start + d.rollout_batch_size]
    if not records:
        raise UserError(f"--dataset {d.dataset}: no records")
    return records


def make_prompts(cfg: BatchInferenceConfig, records: list[Any], tokenizer: Any) -> list[Prompt]:
    """Records -> prompts: the csft condition (--enable_csft), the template, bos, left truncation."""
    from rlhfkit.data.post_processors import edit_prompt
    from rlhfkit.data.templates import PromptFormatter, locate, require_field
    from rlhfkit.data.tokens import encode, with_bos
    from rlhfkit.rl.rollout_source import expand_prompt_images

    d, g = cfg.data, cfg.generation
    formatter = PromptFormatter(tokenizer, d.input_template, d.apply_chat_template, d.tokenizer_chat_template)
    condition = f" {g.csft_prompt.strip()} "
    reader = _record_images(cfg, tokenizer)
    prompts = []
    for i, record in enumerate(records):
        where = locate(record, i)
        written = value = require_field(record, d.input_key, where, "--input_key")
        pixels = None
        if reader is not None:  # the record's images, decoded and processed once; placeholders in its prompt
            decoded = reader.read(record, where)
            value = reader.marked(record, d.input_key, len(decoded), where, "--input_key")[d.input_key]
            pixels = reader.pixels(decoded) if decoded else None
        if g.enable_csft:
            try:
                value = edit_prompt(value, lambda text: text + condition)
                written = edit_prompt(written, lambda text: text + condition)  # the record's input, without images
            except ValueError as e:
                raise UserError(f"{where}: --enable_csft: {e}") from None
        text = formatter(value, where)
        label = require_field(record, d.label_key, where, "--label_key") if d.label_key else None
        ids = with_bos(tokenizer, encode(tokenizer, text))
        if pixels is not None:  # as the RL rollout does: one image-pad token per vision token, never cut
            ids = expand_prompt_images(ids, {"images": pixels, "vision_tokens": reader.tokens}, d.prompt_max_len, i)
        prompts.append(Prompt(written, text, ids[-d.prompt_max_len:], label, pixels))
    return prompts


def _record_images(cfg: BatchInferenceConfig, tokenizer: Any) -> Any:
    """The reader of --image_key images (`rlhfkit.data.images.RecordImages`); None without --image_key. A
    text-only --pretrain is a UserError here, before the model loads."""
    d = cfg.data
    if not d.image_key:
        return None
    from rlhfkit.models.loading import check_model_path, load_model_config
    from rlhfkit.models.vision import record_images

    path = check_model_path(cfg.model.pretrain)
    return record_images(load_model_config(path), path, tokenizer, d.image_key, d.max_images_per_prompt)


# -- engines ------------------------------------------------------------------------------------------------------
class Engines:
    """The generation engine(s) of a run, built from the run's `EngineSpec` by the engine factory: one in this
    process (--num_engines 1), or engine actors on Ray behind one group."""

    def __init__(self, cfg: BatchInferenceConfig, tokenizer: Any):
        from rlhfkit.rollout.factory import check_engines

        self.g = cfg.generation
        self.spec = engine_spec(cfg)
        self.use_gpu = torch.cuda.is_available()
        check_engines(self.spec, self.use_gpu or bool(os.environ.get("RAY_ADDRESS")))
        self.plan: ResourcePlan | None = None
        self.started_ray = False
        if self.spec.num_engines == 1:
            from rlhfkit.rollout.factory import local_engine

            self.engine = local_engine(self.spec, use_gpu=self.use_gpu, tokenizer=tokenizer,
                                       device="cuda" if self.use_gpu else None)
        else:
            self.engine = self._on_ray()

    def _on_ray(self) -> Any:
        import ray

        from rlhfkit.distributed.placement import (
            ResourcePlan,
            RoleDemand,
            bundle_cpus,
            connect_ray,
            unwrap_user_error,
        )
        from rlhfkit.rollout.factory import engine_group

        spec = self.spec
        demand = RoleDemand(spec.placement_role, spec.num_engines, spec.devices_per_engine)
        cpus = bundle_cpus(demand.devices, self.use_gpu)  # the engines generate at once: the cores split over them
        self.started_ray = connect_ray(demand.devices * cpus)
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        plan = self.plan = ResourcePlan.make([demand], use_gpu=use_gpu, cpus_per_bundle=cpus).create()
        try:
            return engine_group(spec, plan, use_gpu=use_gpu)
        except ray.exceptions.RayTaskError as e:
            self.close()
            raise unwrap_user_error(e) from None
        except BaseException:
            self.close()
            raise

    def generate(self, prompt_ids: list[list[int]], seed: int, eos_ids: list[int],
                 images: list[dict[str, torch.Tensor] | None] | None = None) -> list[Any]:
        """Sample for `prompt_ids`; `images`: per prompt its pixel tensors or None (image prompts, the Transformers
        engine)."""
        g = self.g
        temperature = 0.0 if g.greedy_sampling else g.temperature
        with_images = {"images": images} if images is not None else {}
        return self.engine.generate(prompt_ids, max_new_tokens=g.max_new_tokens, temperature=temperature,
                                    top_p=g.top_p, top_k=g.top_k, seed=seed, stop_token_ids=eos_ids, **with_images)

    def close(self) -> None:
        if self.plan is not None:
            if hasattr(self.engine, "shutdown"):
                self.engine.shutdown()
            self.plan.remove()
            self.plan = None
        self.engine = None
        if self.started_ray:
            import ray

            ray.shutdown()
            self.started_ray = False


def generate_samples(cfg: BatchInferenceConfig, prompts: list[Prompt], tokenizer: Any) -> list[dict[str, Any]]:
    """best_of_n samples per prompt, in prompt order: {"prompt" (index), "output", "query"}."""
    g = cfg.generation
    eos = tokenizer.eos_token_id
    engines = Engines(cfg, tokenizer)
    samples: list[dict[str, Any]] = []
    chunk = g.micro_batch_size * g.num_engines  # prompts per generate call
    try:
        with tqdm(total=len(prompts), desc="generate", unit="prompt", dynamic_ncols=True) as bar:
            for start in range(0, len(prompts), chunk):
                batch = list(range(start, min(start + chunk, len(prompts))))
                ids = [prompts[i].ids for i in batch for _ in range(g.best_of_n)]
                images = [prompts[i].images for i in batch for _ in range(g.best_of_n)] if cfg.data.image_key \
                    else None
                seed = cfg.model.seed + start * g.best_of_n  # every sample of the run its own seed
                out = engines.generate(ids, seed, [eos] if eos is not None else [], images)
                responses = [s.response_ids for s in out]
                texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
                raw = tokenizer.batch_decode(responses, skip_special_tokens=False)
                for k, (text, raw_text) in enumerate(zip(texts, raw)):
                    index = batch[k // g.best_of_n]
                    samples.append({"prompt": index, "output": text, "query": prompts[index].text + raw_text})
                bar.update(len(batch))
    finally:
        engines.close()
    return samples


# -- rewards ------------------------------------------------------------------------------------------------------
def score(cfg: BatchInferenceConfig, queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
    """One reward per query from the reward model or --remote_rm_url, in chunks with a progress bar."""
    from rlhfkit.models.loading import resolve_attn_implementation
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.sources import make_remote_reward

    s, m, step = cfg.scoring, cfg.model, cfg.generation.micro_batch_size
    rm_path = reward_model_path(cfg)
    if rm_path:
        scorer = load_scorer(rm_path, value_head_prefix=s.value_head_prefix, max_len=cfg.data.max_len,
                             batch_size=step, bf16=m.bf16, use_fast_tokenizer=not m.disable_fast_tokenizer,
                             attn_implementation=resolve_attn_implementation(m.attn_implementation, m.flash_attn))

        def score_chunk(lo: int, hi: int) -> list[float]:
            return scorer.score(queries[lo:hi])
        source: Any = None
    else:
        source = make_remote_reward([u.strip() for u in (s.remote_rm_url or "").split(",")],
                                    timeout=s.remote_rm_timeout, retries=s.remote_rm_retries)

        def score_chunk(lo: int, hi: int) -> list[float]:
            out = source.score({"queries": queries[lo:hi], "prompts": prompts[lo:hi], "labels": labels[lo:hi]})
            return [float(r) for r in out["rewards"].tolist()]
    rewards: list[float] = []
    try:
        with tqdm(total=len(queries), desc="score", unit="sample", dynamic_ncols=True) as bar:
            for lo in range(0, len(queries), step):
                hi = min(lo + step, len(queries))
                rewards.extend(score_chunk(lo, hi))
                bar.update(hi - lo)
    finally:
        if hasattr(source, "close"):
            source.close()
    return rewards


def has_reward(cfg: BatchInferenceConfig) -> bool:
    return bool(reward_model_path(cfg) or cfg.scoring.remote_rm_url)


# -- the run ------------------------------------------------------------------------------------------------------
def _formatting_tokenizer(cfg: BatchInferenceConfig) -> Any:
    from rlhfkit.models.loading import check_model_path, load_tokenizer

    flag = "--pretrain" if cfg.model.pretrain else "--reward_pretrain"
    path = check_model_path(cfg.model.pretrain or cfg.scoring.reward_pretrain, flag)
    return load_tokenizer(path, use_fast=not cfg.model.disable_fast_tokenizer, flag=flag)


def collect(cfg: BatchInferenceConfig) -> list[dict[str, Any]]:
    """The samples of the run: {"input", "output"} (+ "label"), with "reward" when a reward source is given."""
    records = load_records(cfg)
    tokenizer = _formatting_tokenizer(cfg)
    d = cfg.data
    if cfg.generation.eval_task == "rm":
        from rlhfkit.data.templates import PromptFormatter, locate, require_field

        formatter = PromptFormatter(tokenizer, d.input_template, d.apply_chat_template, d.tokenizer_chat_template)
        out, queries, texts, labels = [], [], [], []
        for i, record in enumerate(records):
            where = locate(record, i)
            value = require_field(record, d.input_key, where, "--input_key")
            response = require_field(record, d.output_key, where, "--output_key")
            if not isinstance(response, str):
                raise UserError(f"{where}: --output_key '{d.output_key}' holds a {type(response).__name__}, not text")
            text = formatter(value, where)
            label = require_field(record, d.label_key, where, "--label_key") if d.label_key else None
            out.append({"input": value, "output": response, **({"label": label} if d.label_key else {})})
            queries.append(text + response)
            texts.append(text)
            labels.append(label)
    else:
        from rlhfkit.models.loading import check_model_path

        check_model_path(cfg.model.pretrain)
        prompts = make_prompts(cfg, records, tokenizer)
        samples = generate_samples(cfg, prompts, tokenizer)
        out = [{"input": prompts[s["prompt"]].input, "output": s["output"],
                **({"label": prompts[s["prompt"]].label} if d.label_key else {})} for s in samples]
        queries = [s["query"] for s in samples]
        texts = [prompts[s["prompt"]].text for s in samples]
        labels = [prompts[s["prompt"]].label for s in samples]
    if has_reward(cfg):
        for record, reward in zip(out, score(cfg, queries, texts, labels)):
            record["reward"] = reward
    return out


def post_process(cfg: BatchInferenceConfig, samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """(records to write, a one-line summary of what was done)."""
    from rlhfkit.data import post_processors as pp

    s = cfg.scoring
    if s.normalize_reward and samples and "reward" in samples[0]:
        for sample, z in zip(samples, pp.normalize_rewards([x["reward"] for x in samples])):
            sample["reward"] = z
    if s.post_processor == "rs":
        kept = pp.rejection_sampling(samples)
        return kept, f"rejection sampling: the best of {len(samples)} samples for each of {len(kept)} prompts"
    if s.post_processor == "csft":
        try:
            kept = pp.conditional_sft(samples, s.reward_template, s.csft_buckets)
        except ValueError as e:
            raise UserError(f"--post_processor csft: {e}") from None
        how = f"{s.csft_buckets} reward buckets" if s.csft_buckets else "rewards"
        return kept, f"conditional SFT: {len(kept)} samples with their {how} in the prompt"
    if s.post_processor == "iter_dpo":
        pairs, dropped = pp.dpo_pairs(samples)
        note = f"; {dropped} prompt(s) dropped because all their samples scored the same" if dropped else ""
        return pairs, f"DPO pairs: {len(pairs)} (best vs worst reward per prompt){note}"
    return samples, f"{len(samples)} samples"


def run_batch_inference(cfg: BatchInferenceConfig) -> dict[str, Any]:
    """Validate, generate and/or score, post-process, write; returns a summary (also printed)."""
    cfg.check_inputs()  # the flags were validated when parsed
    started = time.perf_counter()
    samples = collect(cfg)
    records, what = post_process(cfg, samples)
    if not records:
        raise UserError(f"--post_processor {cfg.scoring.post_processor}: nothing to write ({what}); sample more "
                        "responses per prompt (--best_of_n) or at a higher --temperature")
    count = write_jsonl_atomic(required(cfg.data.output_path, "output_path"), records)
    summary: dict[str, Any] = {"written": count, "samples": len(samples), "seconds": time.perf_counter() - started}
    rewards = [x["reward"] for x in samples if "reward" in x]
    if rewards:
        t = torch.tensor(rewards, dtype=torch.float64)
        summary.update(reward_mean=float(t.mean()), reward_std=float(t.std()) if len(rewards) > 1 else 0.0)
    reward_text = (f"; reward mean {summary['reward_mean']:.4f} std {summary['reward_std']:.4f}"
                   if rewards else "")
    print(f"batch_inference: {what}{reward_text}; wrote {count} records to {cfg.data.output_path} in "
          f"{summary['seconds']:.1f} s", flush=True)
    return summary
