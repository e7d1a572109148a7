"""What the preference trainers (reward model, DPO, KTO) share: the loop with named, weighted metrics, sequence
log-probs of a batch, the frozen reference model, and the assembly of a policy with its reference.

`PreferenceTrainer` is the shared loop (`offline.OfflineTrainer`) where a micro step returns named metrics as
(sum, weight) pairs, reduced over micro batches and ranks into weighted means. So accuracies, per-label means and
losses are all exact over the whole optimizer step, whatever the micro-batch split.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rlhfkit.algorithms.sft_loss import shifted_target_mask, token_logprobs
from rlhfkit.config.base import required
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.models.policy import (
    attn_implementation_of,
    dense_rows,
    first_target_position,
    forward_logits,
    from_position,
    keep_logits_from,
    model_dtype,
    model_inputs,
)
from rlhfkit.models.sequence_parallel import sequence_parallel_sample_logps, sequence_parallel_size
from rlhfkit.models.shared_prefix import after_prefix, share_prefixes, shared_prefix_logits
from rlhfkit.run.setup import OfflineRun
from rlhfkit.trainers.offline import OfflineTrainer

PolicyConfig = TypeVar("PolicyConfig", bound=DPOConfig | KTOConfig)  # a run trained against a frozen reference
Sums = dict[str, tuple[float, float]]  # metric name -> (sum, weight); the reported value is sum / weight


def add_sums(total: dict[str, list[float]], part: Sums) -> None:
    for name, (value, weight) in part.items():
        acc = total.setdefault(name, [0.0, 0.0])
        acc[0] += float(value)
        acc[1] += float(weight)


class PreferenceTrainer(OfflineTrainer):
    """The shared loop with named, weighted metrics. Subclasses define `loss(batch) -> (loss, Sums)` of one micro
    batch, or override `micro_step` (forward, backward, step) and `eval_step` (forward only), both returning
    `Sums`."""

    kind = "preference"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.last_eval: dict[str, float] | None = None  # metrics of the latest evaluate()

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        raise NotImplementedError

    def micro_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        loss, sums = self.loss(batch)
        self.backward_and_step(loss)
        return sums

    def eval_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        return self.loss(batch)[1]

    def reduce(self, total: dict[str, list[float]]) -> dict[str, float]:
        """Weighted means over ranks: one all-reduce of every sum and weight (same key order on every rank)."""
        names = sorted(total)
        flat = torch.tensor([total[n][i] for n in names for i in (0, 1)], dtype=torch.float64)
        flat = self.strategy.all_reduce(flat, "sum")
        return {n: (flat[2 * k] / flat[2 * k + 1]).item() if flat[2 * k + 1] > 0 else float("nan")
                for k, n in enumerate(names)}

    rows_per_sample = 2  # a pair is a chosen and a rejected row

    def sample_size(self, sample: Any) -> tuple[int, int]:
        prompt = len(sample["prompt_ids"])
        chosen, rejected = prompt + len(sample["chosen_ids"]), prompt + len(sample["rejected_ids"])
        return chosen + rejected, max(chosen, rejected)

    def train_batch(self, micro: Sequence[Sequence[int]], started: float,
                    global_batch: Sequence[int]) -> dict[str, float]:
        """One optimizer step. The losses are means over samples: a micro-batch's weight in the step is its share of
        the step's samples (x world size, as DeepSpeed averages over ranks), whatever the split."""
        sums: dict[str, list[float]] = {}
        # the ranks of a sequence-parallel group share a micro-batch, and its loss's backward sums their
        # gradients (`sum_over_group`): so the share is by data-parallel rank
        per_rank = len(global_batch) / self.strategy.dp_world_size
        for (batch, real), indices in zip(self.micro_batches(micro, global_batch), micro):
            self.micro_scale = len(indices) / per_rank
            part = self.micro_step(batch)
            add_sums(sums, part if real else {k: (0.0, 0.0) for k in part})
        self.micro_scale = 1.0
        metrics = self.reduce(sums)
        metrics.update(lr=self.engine.get_lr()[0], epoch=self.state.epoch,
                       samples_per_s=self.args.train_batch_size / max(time.perf_counter() - started, 1e-9))
        return metrics

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: metrics[k] for k in ("loss", "acc") if k in metrics}

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float] | None:
        """Metrics of `eval_step` over the whole eval set (sharded over ranks), logged with prefix `eval`."""
        if not self.eval_samples:
            return None
        self.engine.eval()
        sums: dict[str, list[float]] = {}
        for batch, real in self.sharded_batches(self.eval_samples):
            part = self.eval_step(batch)
            add_sums(sums, part if real else {k: (0.0, 0.0) for k in part})
        self.engine.train()
        metrics = self.reduce(sums)
        self.logger.log(step, metrics, prefix="eval")
        self.strategy.print(f"{self.kind} eval at step {step}: " +
                            ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
        self.last_eval = metrics
        return metrics


def pair_sums(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> Sums:
    """Loss, accuracy (chosen scored above rejected), mean chosen/rejected scores and their margin."""
    n = chosen.numel()
    return {"loss": (loss.item() * n, n), "acc": ((chosen > rejected).sum().item(), n),
            "chosen_reward": (chosen.sum().item(), n), "rejected_reward": (rejected.sum().item(), n),
            "margin": ((chosen - rejected).sum().item(), n)}


def per_sample_sums(values: torch.Tensor, mask: torch.Tensor,
                    sample_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of `values` [rows, T-1] under `mask` per sample, and the number of masked-in positions per sample.

    Padded batches: one sample per row -> [rows]. Packed batches: sample_ids [1, T] name the sample of every
    token; position t of `values` belongs to token t+1 -> [number of samples], in sample-id order."""
    mask = mask.to(values.dtype)
    if sample_ids is None:
        return (values * mask).sum(dim=-1), mask.sum(dim=-1)
    owner = sample_ids[:, 1:].reshape(-1).clamp(min=0)
    num_samples = int(sample_ids.max().item()) + 1
    flat_mask = mask.reshape(-1)
    sums = values.new_zeros(num_samples).index_add(0, owner, values.reshape(-1) * flat_mask)
    counts = values.new_zeros(num_samples).index_add(0, owner, flat_mask)
    return sums, counts


def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor], fp32: bool = False,
                   aux_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sum of response-token log-probs [n], response-token counts [n], MoE aux loss or None) of every sample of
    a padded or packed batch, from one forward pass. Log-probs are float32 (`token_logprobs`); `fp32` also runs
    the logits in float32 first. A padded batch runs as fewer, fuller rows where it can (`dense_rows`), and the LM
    head and the last decoder layer skip the prompt columns that no row predicts from (`forward_logits`)."""
    if sequence_parallel_size() > 1:  # this rank's slice of every sample; sums over the group (no MoE aux loss)
        return (*sequence_parallel_sample_logps(model, batch, fp32), None)
    inner = getattr(model, "module", model)
    # the shared-prompt forward runs ids only: a batch with images (or packed) takes the plain path
    shared = _shared_prompt_logps(model, batch, fp32) if not {"sample_ids", "pixel_values"} & set(batch) else None
    if shared is not None:
        return (*shared, None)
    batch = dense_rows(model, batch)
    aux_loss = aux_loss and hasattr(inner.config, "output_router_logits")  # mixture-of-experts models only
    start = first_target_position(batch)  # no LM head on the prompt columns before any target
    output = None
    if aux_loss:  # the router loss is on the model's output
        inputs = model_inputs(batch, attn_implementation_of(inner), model_dtype(inner))
        output = model(**inputs, **keep_logits_from(model, batch, start), use_cache=False, output_router_logits=True)
        logits = output.logits[:, start - batch["input_ids"].shape[1]:] if start > 0 else output.logits
    else:  # with start > 0 the last decoder layer too runs from `start` on only
        logits = forward_logits(model, batch, start)
    logits = logits[:, :-1]
    batch = from_position(batch, start)
    if fp32:
        logits = logits.float()
    sample_ids = batch.get("sample_ids")
    mask = shifted_target_mask(batch["loss_mask"], sample_ids)
    labels = batch["input_ids"][:, 1:].masked_fill(~mask, -100)  # token_logprobs gives 0 for a label < 0
    sums, counts = per_sample_sums(token_logprobs(logits, labels), mask, sample_ids)
    return sums, counts, getattr(output, "aux_loss", None) if output is not None else None


def _shared_prompt_logps(model: nn.Module, batch: dict[str, torch.Tensor], fp32: bool
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`sequence_logps` of a padded batch whose rows repeat a prompt (a DPO pair's chosen and rejected), each
    prompt run once (`rlhfkit.models.shared_prefix`); None when that does not pay or apply."""
    if not pair_prompts_share_a_pass(batch["loss_mask"].device):
        return None
    loss_mask = batch["loss_mask"].bool()
    if not bool(loss_mask.any(dim=1).all()):
        return None
    prefix_lengths = loss_mask.int().argmax(dim=1)  # each row's first target token
    groups = share_prefixes(model, batch["input_ids"], batch["attention_mask"], prefix_lengths)
    if groups is None:
        return None
    last = loss_mask.shape[1] - 1 - loss_mask.flip(1).int().argmax(dim=1)
    width = int((last - prefix_lengths).max()) + 1
    logits = shared_prefix_logits(model, batch["input_ids"], batch["attention_mask"], prefix_lengths, width, groups)
    mask = after_prefix(loss_mask, prefix_lengths, width).bool()
    labels = after_prefix(batch["input_ids"], prefix_lengths, width).masked_fill(~mask, -100)
    return per_sample_sums(token_logprobs(logits.float() if fp32 else logits, labels), mask)


def pair_prompts_share_a_pass(device: torch.device) -> bool:
    """Whether a DPO/KTO batch on `device` runs each pair's prompt once (two forward passes) rather than the plain
    single pass over every row: on the CPU only. On a GPU the preference step is bound by kernel launches, not
    FLOPs: on an H200 (bench/results/gpu_profile.md, call 3) the shared-prompt pass doubled the step's CPU time and
    took 0.50 s a step against the plain pass's 0.29 s under the profiler (Qwen2.5-0.5B shape, 8 pairs of
    ~140-token prompts)."""
    return device.type == "cpu"


def load_frozen_model(model_or_path: Any, value_head_prefix: str = "score") -> nn.Module:
    """An eval-mode, gradient-free model: a module as given, or a directory loaded as a reward model (when it
    was saved as a sequence classifier) or as a causal LM."""
    if isinstance(model_or_path, nn.Module):
        model = model_or_path
    else:
        from rlhfkit.models.loading import check_model_path, load_causal_lm
        from rlhfkit.models.value_model import load_value_model

        path = check_model_path(str(model_or_path), "model")
        with open(os.path.join(path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            model = load_value_model(path, value_head_prefix=value_head_prefix, flag="model")
        else:
            model = load_causal_lm(path, flag="model")
    model.requires_grad_(False)
    return model.eval()


def tokenizer_source(model_or_path: Any, model: nn.Module) -> str:
    """Where the tokenizer of `load_frozen_model(model_or_path)` is: the path given, else the model's own."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return os.fspath(model_or_path)
    return str(model.name_or_path)  # a Transformers model's (nn.Module types the attribute as Tensor | Module)


class FrozenReference:
    """The frozen reference policy: log-probs without gradients, optionally parked on the CPU between uses."""

    def __init__(self, strategy: DeepSpeedStrategy, model: nn.Module, offload: bool = False, fp32: bool = False):
        self.strategy = strategy
        self.fp32 = fp32
        zero3 = strategy.args.zero_stage == 3
        # Under ZeRO-3 DeepSpeed itself keeps the parameter shards on the CPU (offload_param); otherwise the
        # whole module moves to the accelerator for each forward and back.
        self.move = offload and not zero3
        self.model = zero3_offloaded_eval(strategy, model) if offload and zero3 else strategy.prepare_eval(model)
        if self.move:
            self.model.to("cpu")

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.move:
            self.model.to(self.strategy.device)
        try:
            sums, counts, _ = sequence_logps(self.model, batch, self.fp32)
        finally:
            if self.move:
                self.model.to("cpu")
        return sums, counts


def zero3_offloaded_eval(strategy: DeepSpeedStrategy, model: nn.Module) -> nn.Module:
    """A frozen ZeRO-3 inference engine whose parameter shards live on the CPU (DeepSpeed offload_param)."""
    from rlhfkit.distributed.launch import import_deepspeed

    deepspeed = import_deepspeed()

    model.requires_grad_(False)
    model.eval()
    config = strategy.ds_config(train=False)
    config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return engine


def load_reference(cfg: DPOConfig | KTOConfig, strategy: DeepSpeedStrategy, attn: str) -> FrozenReference:
    """The reference model of DPO/KTO: --ref_pretrain, else --pretrain."""
    from rlhfkit.models.loading import check_model_path, load_causal_lm

    flag = "--ref_pretrain" if cfg.reference.ref_pretrain else "--pretrain"
    path = check_model_path(cfg.reference.ref_pretrain or cfg.model.pretrain, flag)
    model = load_causal_lm(path, attn_implementation=attn, dtype=torch.float32, flag=flag)
    return FrozenReference(strategy, model, cfg.reference.ref_offload, cfg.train.compute_fp32_loss)


def prepare_policy_and_reference(cfg: PolicyConfig, kind: str,
                                 load_datasets: Callable[[PolicyConfig, Any], tuple[Any, Any]]
                                 ) -> tuple[OfflineRun, FrozenReference]:
    """DPO and KTO: the run (`setup.assemble_offline`, --ref_pretrain checked with the other inputs before any
    process group starts) and its frozen reference."""
    from rlhfkit.run.setup import assemble_offline

    run = assemble_offline(cfg, kind, load_datasets, model_paths=[(cfg.reference.ref_pretrain, "--ref_pretrain")])
    try:
        return run, load_reference(cfg, run.strategy, run.attn)
    except BaseException:
        run.logger.close()
        raise


def load_pair_datasets(cfg: RMConfig | DPOConfig, tokenizer: Any, need_margin: bool = False) -> tuple[Any, Any]:
    """Tokenised (train, eval or None) PreferenceDatasets from the data and pair sections of `cfg`."""
    from rlhfkit.data.preference_dataset import PreferenceDataset
    from rlhfkit.data.readers import load_mixture
    from rlhfkit.run.setup import load_record_images

    d, p = cfg.data, cfg.pairs
    images = load_record_images(cfg, tokenizer)  # None without --image_key

    def build(spec: str, probs: str | None, split: str, max_samples: int | None, flag: str) -> PreferenceDataset:
        records = load_mixture(spec, probs, split, max_samples, cfg.strategy.seed, arg_name=flag)
        return PreferenceDataset(records, tokenizer, d.max_len, prompt_key=p.prompt_key, chosen_key=p.chosen_key,
                                 rejected_key=p.rejected_key, margin_key=p.margin_key if need_margin else None,
                                 input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                 tokenizer_chat_template=d.tokenizer_chat_template, images=images)

    train = build(required(d.dataset, "dataset"), d.dataset_probs, d.dataset_split, d.max_samples, "--dataset")
    evalset = build(d.eval_dataset, None, d.eval_split, None, "--eval_dataset") if d.eval_dataset else None
    return train, evalset
