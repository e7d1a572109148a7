"""The optimizer and learning-rate schedule of a trained model, built from its `StrategyArgs`.

`--optim adam` (the default): AdamW, no weight decay on biases and norms.

`--optim muon`: torch's `torch.optim.Muon` for the hidden layers' weight matrices, AdamW for the rest (embeddings,
the LM head, value / reward heads, norms, biases), as the Muon papers prescribe: Jordan et al. 2024, "Muon: An
optimizer for hidden layers in neural networks" (SGD momentum whose update of a 2-D weight is replaced by its
nearest semi-orthogonal matrix, computed with a few Newton-Schulz iterations), and Liu et al. 2025, "Muon is
scalable for LLM training" (weight decay on the Muon group). The flags and defaults are OpenRLHF 0.11's: the Muon
group runs at `--muon.lr` (0.02) with `--muon.momentum`, `--muon.ns_steps`, `--muon.nesterov` and the AdamW
weight decay; the AdamW group at the run's learning rate, betas and eps; the schedule scales both groups alike.
torch's Muon scales a matrix's step by sqrt(max(1, rows / cols)) (Keller Jordan's "original" rule, as DeepSpeed's
Muon that OpenRLHF uses) and runs the Newton-Schulz iteration in bfloat16.

The schedules are Transformers' (`rlhfkit.algorithms.lr_schedule`, without importing them); `--min_lr_ratio` is the
floor of `cosine_with_min_lr`.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.lr_schedule import schedule
from rlhfkit.config.common import StrategyArgs
from rlhfkit.errors import UserError


def adamw_kernel(params: list[nn.Parameter]) -> dict[str, bool]:
    """`fused=True` where torch has a fused AdamW kernel for every parameter's device (CPU and CUDA in torch 2.13:
    17.6 ms instead of 75 ms per step on 26.7M fp32 parameters on CPU), else `foreach=True`."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    if params and all(p.device.type in supported and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


def _embedding_ids(model: nn.Module) -> set[int]:
    """Parameters of the input and output embeddings (the LM head, tied or not): AdamW's under Muon."""
    ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    get_output = getattr(model, "get_output_embeddings", None)  # a Transformers model's (None without a head)
    head = get_output() if callable(get_output) else None
    if isinstance(head, nn.Module):
        ids |= {id(p) for p in head.parameters()}
    return ids


def split_for_muon(model: nn.Module) -> tuple[list[nn.Parameter], list[tuple[str, nn.Parameter]]]:
    """(Muon's parameters, AdamW's named parameters): Muon takes the trainable 2-D weights of hidden layers, that
    is every matrix but the embeddings, the LM head and a one-row head (a value or reward head, [1, hidden])."""
    embeddings = _embedding_ids(model)
    muon: list[nn.Parameter] = []
    adamw: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and id(p) not in embeddings:
            muon.append(p)
        else:
            adamw.append((name, p))
    return muon, adamw


def adamw_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with `weight_decay`, except biases, norms and other vectors (no decay)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in named:
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # LoRA has no 1-D trainable parameters


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: `torch.optim.Muon` on the Muon groups, `torch.optim.AdamW` on the others.

    `param_groups` is the two optimizers' groups (the same dicts), so an LR schedule, gradient clipping and
    `zero_grad` see every parameter; `state` reads both optimizers' per-parameter states (the sleep-mode byte count
    does) and the state dict holds both."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer | None):
        self.muon, self.adamw = muon, adamw
        super().__init__([p for g in self._parts_groups() for p in g["params"]], {})
        self._link()

    def _link(self) -> None:
        """Point `param_groups` and `state` at the parts' own (again after loading, which replaces them)."""
        self.param_groups = self._parts_groups()
        self.state = ChainMap(*(part.state for part in self._parts()))  # type: ignore[assignment]

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [self.muon] + ([self.adamw] if self.adamw is not None else [])

    def _parts_groups(self) -> list[dict[str, Any]]:
        return [g for part in self._parts() for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for part in self._parts():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])
        self._link()


def _muon(args: StrategyArgs, model: nn.Module, learning_rate: float) -> MuonWithAdamW:
    muon_params, rest = split_for_muon(model)
    if not muon_params:
        raise UserError("--optim muon: the model has no hidden-layer weight matrix for Muon; use --optim adam")
    muon = torch.optim.Muon(muon_params, lr=args.muon_lr, weight_decay=args.l2, momentum=args.muon_momentum,
                            nesterov=args.muon_nesterov, ns_steps=args.muon_ns_steps)
    groups = adamw_groups(rest, args.l2)
    params = [p for g in groups for p in g["params"]]
    adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=(args.adam_betas[0], args.adam_betas[1]),
                              eps=args.adam_eps, **adamw_kernel(params)) if groups else None
    return MuonWithAdamW(muon, adamw)


def check_deepspeed_optimizer(args: StrategyArgs, bf16: bool) -> None:
    """Muon under DeepSpeed runs at ZeRO-0 in fp32 (DeepSpeed then averages the gradients over the ranks and steps
    the client optimizer on whole weights); ZeRO-1/2/3, the bf16 optimizer and CPU Adam hand the optimizer flat 1-D
    shards, which torch's Muon cannot orthogonalise."""
    if args.optim == "muon" and (args.zero_stage > 0 or bf16 or args.adam_offload):
        raise UserError("--optim muon over several processes needs --zero_stage 0, fp32 weights (--param_dtype fp32 "
                        "on a GPU) and no --adam_offload: ZeRO-1/2/3 and DeepSpeed's bf16 optimizer hand it flat "
                        "1-D shards, which torch's Muon cannot orthogonalise (one process runs any stage below 3)")


def make_optimizer(args: StrategyArgs, model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    """The optimizer `args` asks for (`--optim`) over `model`'s trainable parameters. With --adam_offload it is
    DeepSpeed's CPU Adam (it compiles once); else a client optimizer, which avoids DeepSpeed's fused-Adam compile."""
    if args.optim == "muon":
        return _muon(args, model, learning_rate)
    groups = adamw_groups([(n, p) for n, p in model.named_parameters() if p.requires_grad], args.l2)
    betas = (args.adam_betas[0], args.adam_betas[1])
    if args.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=learning_rate, betas=betas, eps=args.adam_eps, adamw_mode=True)
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=args.adam_eps, **adamw_kernel(params))


def make_scheduler(args: StrategyArgs, optimizer: torch.optim.Optimizer, num_update_steps: int) -> Any:
    """Warmup over `--lr_warmup_ratio` of the steps, then `--lr_scheduler` (cosine_with_min_lr ends at
    `--min_lr_ratio` x each group's peak)."""
    warmup = int(round(args.lr_warmup_ratio * num_update_steps))
    min_lr_rate = args.min_lr_ratio if args.lr_scheduler == "cosine_with_min_lr" else 0.0
    factor = schedule(args.lr_scheduler, warmup, max(num_update_steps, 1), min_lr_rate)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
