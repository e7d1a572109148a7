"""DeepSpeed ZeRO 0-3 behind one small interface: prepare models, step, reduce, save and load.

At world size 1 without a DeepSpeed feature (fp32, no offload, ZeRO < 3) training runs on a
`PlainTorchEngine` with the same interface and arithmetic (`rlhfkit/distributed/plain_torch_engine.py`):
DeepSpeed's gradient all-reduce machinery costs time even over one rank.

Batching rule (shared by every trainer): an optimizer step consumes `train_batch_size` samples in total; each
rank runs micro-batches of `micro_train_batch_size`; DeepSpeed accumulates
`train_batch_size / (micro_train_batch_size * world_size)` of them and averages gradients over ranks.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlhfkit.config.common import StrategyArgs, check_batch_split
from rlhfkit.config.sequence_parallel import check_ring_world
from rlhfkit.distributed import optimizers, tensor_parallel
from rlhfkit.distributed.determinism import enable_full_determinism, flag_from_env, note_gpu_limits
from rlhfkit.distributed.launch import (
    default_ds_accelerator,
    import_deepspeed,
    init_distributed,
    world_size_from_env,
)
from rlhfkit.distributed.plain_torch_engine import PlainTorchEngine
from rlhfkit.models.sequence_parallel import check_heads, set_sequence_parallel_group

default_ds_accelerator()


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class RngState:
    """Every random generator a rank uses, for exact resume."""

    python: Any
    numpy: Any
    torch: torch.Tensor

    @staticmethod
    def capture() -> RngState:
        return RngState(random.getstate(), np.random.get_state(), torch.get_rng_state())

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)


class DeepSpeedStrategy:
    """Owns the process group and turns models into DeepSpeed engines."""

    def __init__(self, args: StrategyArgs, bf16: bool = False, gradient_checkpointing: bool = False,
                 gradient_checkpointing_use_reentrant: bool = False):
        self.args = args
        self.bf16 = bf16
        self.gradient_checkpointing = gradient_checkpointing
        self.gradient_checkpointing_use_reentrant = gradient_checkpointing_use_reentrant
        # --ring_attn_size ranks share each sample (sequence parallelism) and --ds_tensor_parallel_size ranks each
        # sample and its whole computation (`rank` and `world_size` leave TP's duplicates out): the batch splits
        # over world / both
        self.tp = getattr(args, "ds_tensor_parallel_size", 1)
        sp = args.ring_attn_size
        self.accumulation_steps = check_batch_split(
            args.train_batch_size, args.micro_train_batch_size,
            check_ring_world(sp, world_size_from_env() // self.tp),
            "world size" if sp == self.tp == 1 else
            f"data-parallel world size (world / --ring_attn_size {sp} / --ds_tensor_parallel_size {self.tp})")

    # -- process group -------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        init_distributed(self.args.ddp_timeout)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if self.args.full_determinism:
            in_ray_worker = flag_from_env()  # set by the Ray driver, which prints the GPU note once for the run
            enable_full_determinism()
            if not in_ray_worker:
                note_gpu_limits(self.print)
        set_seed(self.args.seed)
        self._join_sequence_parallel_group()

    def _join_sequence_parallel_group(self) -> None:
        """Ranks [k x size, (k + 1) x size) form sequence-parallel group k (`rlhfkit.models.sequence_parallel`);
        every rank creates every group, as torch.distributed.new_group is collective."""
        size = self.args.ring_attn_size
        if size == 1:
            set_sequence_parallel_group(None)
            return
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, self.world_size, size)]
        set_sequence_parallel_group(groups[self.rank // size])

    @property
    def rank(self) -> int:
        """The process rank with tensor parallelism's duplicates left out (global rank // TP size)."""
        return tensor_parallel.dp_rank(self.tp)

    @property
    def world_size(self) -> int:
        """The ranks that see different data or parts of it: world / --ds_tensor_parallel_size."""
        return tensor_parallel.dp_size(self.tp)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of a sequence-parallel group share it (and their samples)."""
        return self.rank // self.args.ring_attn_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: world size / --ring_attn_size."""
        return self.world_size // self.args.ring_attn_size

    @property
    def is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def print(self, *args: Any) -> None:
        if self.is_rank0:
            print(*args, flush=True)

    @overload
    def all_reduce(self, value: float, op: str = "mean") -> float: ...
    @overload
    def all_reduce(self, value: torch.Tensor, op: str = "mean") -> torch.Tensor: ...

    def all_reduce(self, value: float | torch.Tensor, op: str = "mean") -> float | torch.Tensor:
        """Reduce a number or tensor over ranks, one per TP group (`mean`, `sum` or `max`)."""
        is_number = not isinstance(value, torch.Tensor)
        t = (value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)).clone()
        if self.world_size > 1:
            reduce_op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            device_t = t.to(self.device)
            dist.all_reduce(device_t, op=reduce_op, group=tensor_parallel.dp_group(self.tp))
            t = device_t.cpu()
            if op == "mean":
                t = t / self.world_size
        return t.item() if is_number else t

    # -- DeepSpeed configs -----------------------------------------------------------------------------------
    def ds_config(self, train: bool = True) -> dict[str, Any]:
        a = self.args
        zero: dict[str, Any] = {
            "stage": a.zero_stage,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": "auto" if False else 10_000,
            "overlap_comm": a.overlap_comm,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "zero_hpz_partition_size": a.zpg,
        }
        if train and a.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        config: dict[str, Any] = {
            # DeepSpeed checks train = micro x accumulation x world, counting every rank as data-parallel; the
            # --ring_attn_size ranks of a sequence-parallel group share their samples
            "train_batch_size": a.train_batch_size * a.ring_attn_size,
            "train_micro_batch_size_per_gpu": a.micro_train_batch_size,
            "gradient_accumulation_steps": self.accumulation_steps,
            "gradient_clipping": a.max_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True,
        }
        if a.grad_accum_dtype:
            config["data_types"] = {"grad_accum_dtype": a.grad_accum_dtype}
        if train and a.deepcompile:  # --deepcompile (GPU only, checked at parse time); see prepare_train
            config["compile"] = {"deepcompile": True}
        if not train:
            config.pop("gradient_clipping")
            zero.pop("zero_hpz_partition_size")
        return config

    # -- models ----------------------------------------------------------------------------------------------
    def make_optimizer(self, model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
        """`--optim`'s optimizer (AdamW, or Muon with AdamW): `rlhfkit.distributed.optimizers`."""
        return optimizers.make_optimizer(self.args, model, learning_rate)

    def make_scheduler(self, optimizer: torch.optim.Optimizer, num_update_steps: int) -> Any:
        return optimizers.make_scheduler(self.args, optimizer, num_update_steps)

    def uses_plain_torch_engine(self) -> bool:
        """True when DeepSpeed would add only cost: one process, fp32, no optimizer offload, no ZeRO-3 sharding
        (ZeRO-1/2 partition nothing over one rank). See `rlhfkit/distributed/plain_torch_engine.py`."""
        a = self.args
        return (self.world_size == 1 and not self.bf16 and not a.adam_offload and a.zero_stage < 3
                and a.grad_accum_dtype in (None, "fp32") and not a.deepcompile)

    def prepare_train(self, model: nn.Module, learning_rate: float, num_update_steps: int) -> Any:
        """A training engine that owns `model`, its optimizer (--optim) and the LR schedule: a DeepSpeed engine, or
        at world size 1 without a DeepSpeed feature a `PlainTorchEngine` with the same interface and numbers."""
        enable_checkpointing = getattr(model, "gradient_checkpointing_enable", None)  # a Transformers model's
        if self.gradient_checkpointing and enable_checkpointing is not None:
            enable_checkpointing(
                gradient_checkpointing_kwargs={"use_reentrant": self.gradient_checkpointing_use_reentrant})
        if self.args.ring_attn_size > 1:
            check_heads(model, self.args.ring_attn_size)
        if self.args.backend == "fsdp2":
            from rlhfkit.distributed.fsdp2_engine import prepare_fsdp2

            return prepare_fsdp2(self, model, learning_rate, num_update_steps)
        if self.uses_plain_torch_engine():
            model = model.to(self.device)
            optimizer = self.make_optimizer(model, learning_rate)
            scheduler = self.make_scheduler(optimizer, num_update_steps)
            return PlainTorchEngine(model, optimizer, scheduler, self.accumulation_steps, self.args.max_norm,
                               self.args.train_batch_size)
        optimizers.check_deepspeed_optimizer(self.args, self.bf16)
        deepspeed = import_deepspeed()

        optimizer = self.make_optimizer(model, learning_rate)
        scheduler = self.make_scheduler(optimizer, num_update_steps)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=self.ds_config(train=True), dist_init_required=False)
        if self.args.deepcompile:  # DeepSpeed builds its compiled graph on the first step after compile()
            engine.compile()
        return engine

    def prepare_eval(self, model: nn.Module, shard_fsdp2: bool = False) -> nn.Module:
        """A frozen model for inference (reference / reward): a ZeRO-3 engine shards it, and so does FSDP2 where
        the caller asks (`shard_fsdp2`: the RL roles; DPO/KTO's reference stays a whole copy per rank), else a
        plain module."""
        model.requires_grad_(False)
        model.eval()
        if self.args.backend == "fsdp2" and shard_fsdp2:
            from rlhfkit.distributed.fsdp2_engine import prepare_frozen

            return prepare_frozen(model.to(dtype=torch.bfloat16 if self.bf16 else torch.float32))
        if self.args.zero_stage == 3:
            deepspeed = import_deepspeed()

            engine, _, _, _ = deepspeed.initialize(model=model, config=self.ds_config(train=False),
                                                   dist_init_required=False)
            return engine
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        return model.to(device=self.device, dtype=dtype)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def full_state_dict(self, engine: nn.Module) -> dict[str, torch.Tensor] | None:
        """All weights on rank 0 (gathered from ZeRO-3 shards), None on the other ranks."""
        module = self.unwrap(engine)
        gather_shards = getattr(engine, "full_state_dict", None)  # an FSDP2 engine's
        if gather_shards is not None:
            return gather_shards()
        consolidated = getattr(engine, "_zero3_consolidated_16bit_state_dict", None)  # a DeepSpeed engine's
        if self.args.zero_stage == 3 and consolidated is not None:
            state = consolidated()
            return state if self.is_rank0 else None
        if not self.is_rank0:
            return None
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def save_hf_model(self, engine: nn.Module, tokenizer: Any, path: str) -> None:
        """Save a Hugging Face model directory that plain `from_pretrained` loads (LoRA merged)."""
        from rlhfkit.models.lora import merged_for_saving
        from rlhfkit.models.publish import publish_model_dir, staging_dir

        state = self.full_state_dict(engine)
        if self.is_rank0:  # written beside `path`, then moved in config.json last: a kill leaves no half model
            module: Any = self.unwrap(engine)  # a Transformers or PEFT model: both have save_pretrained
            export = getattr(engine, "export_module", None)  # an FSDP2 engine's (LoRA: an unsharded copy)
            if export is not None and state is not None:
                module = export(state)
            staging = staging_dir(path)
            if hasattr(module, "peft_config"):
                module.save_pretrained(str(staging / "lora_adapter"), state_dict=state)
                module = merged_for_saving(module)
                state = None
            module.save_pretrained(str(staging), state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staging))
            publish_model_dir(staging, path)
        self.barrier()
