"""The flags of OpenRLHF's FSDP2 branch (its PR 1176, "migrate from DeepSpeed to FSDP2"; in no release up to
0.11.0), whose train_ppo_ray and 64k-context scripts use `--fsdp2_enable_sleep`, `--fsdp2_cp_size` and others.

FSDP2 is the only backend there, so each of its FSDP2 flags here also selects `--backend fsdp2` (a `--backend
deepspeed` or a `--zero_stage` beside one stops with one line) and sets the rlhfkit flag that does the same thing:
- `--fsdp2_enable_sleep`: `--deepspeed_enable_sleep` (each role's states leave the GPU between its calls);
- `--fsdp2_cpu_offload`: `--adam_offload` (CPUOffloadPolicy: shards, gradients and AdamW state in CPU memory). The
  branch turns its sleep off under CPU offload; here both may be given, and sleep then moves nothing (the shards
  are already in CPU memory);
- `--fsdp2_cp_size N`: `--ring_attn_size N` (its context parallelism is ring attention with `--ring_head_stride`);
- `--fsdp2_tp_size N`: `--ds_tensor_parallel_size N` (torch tensor parallel on FSDP2);
- `--fsdp2_reshard_after_forward`: what FSDP2 units do here always; `--no-fsdp2_reshard_after_forward` is refused.
`rlhfkit.config.openrlhf_names` turns `ADAPTED` into its `Adapted` entries and takes `NOT_SUPPORTED` in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhfkit.errors import UserError

_BRANCH = "OpenRLHF's FSDP2 branch (PR 1176): --backend fsdp2"


def _fsdp2(field: str | None = None, kind: type = bool) -> Callable[[Any, Callable[[str], Any]], dict[str, Any]]:
    """--backend fsdp2 and `field`: a store_true flag (`kind` bool) given bare means on, and a config file's
    `false` turns the setting off; another kind converts the flag's value."""
    def convert(value: Any, current: Callable[[str], Any]) -> dict[str, Any]:
        if kind is not bool:
            return {"backend": "fsdp2", **({field: kind(value)} if field else {})}
        if value not in (None, True, False):
            raise UserError(f"--{field} takes no value (got {value})")
        return {"backend": "fsdp2", **({field: value in (None, True)} if field else {})}
    return convert


def _reshard_after_forward(value: Any, current: Callable[[str], Any]) -> dict[str, Any]:
    if value is False:  # a config file's `fsdp2_reshard_after_forward: false`
        raise UserError("--no-fsdp2_reshard_after_forward is not supported yet by rlhfkit (FSDP2 units always free "
                        "their gathered parameters after the forward)")
    return _fsdp2()(value, current)


#: `openrlhf_names.Adapted` arguments: flag, our fields, converter, value type, nargs, metavar, help
ADAPTED: tuple[tuple[Any, ...], ...] = (
    ("fsdp2_enable_sleep", ("backend", "deepspeed_enable_sleep"), _fsdp2("deepspeed_enable_sleep"), str, "?", "",
     f"{_BRANCH} --deepspeed_enable_sleep (each role's states leave the GPU between its calls)."),
    ("fsdp2_cpu_offload", ("backend", "adam_offload"), _fsdp2("adam_offload"), str, "?", "",
     f"{_BRANCH} --adam_offload (CPUOffloadPolicy: shards, gradients and AdamW state in CPU memory)."),
    ("fsdp2_cp_size", ("backend", "ring_attn_size"), _fsdp2("ring_attn_size", int), int, None, "N",
     f"{_BRANCH} --ring_attn_size N (context parallel: N ranks share each sample)."),
    ("fsdp2_tp_size", ("backend", "ds_tensor_parallel_size"), _fsdp2("ds_tensor_parallel_size", int), int, None,
     "N", f"{_BRANCH} --ds_tensor_parallel_size N (torch tensor parallel)."),
    ("fsdp2_reshard_after_forward", ("backend",), _reshard_after_forward, str, "?", "",
     f"{_BRANCH} (units free their gathered parameters after the forward, always the case here)."),
)

NOT_SUPPORTED: dict[str, str] = {
    "no-fsdp2_reshard_after_forward": "FSDP2 units always free their gathered parameters after the forward",
    "fsdp2_tp_sequence_parallel": "tensor parallelism splits the projections only; norms and activations between "
                                  "them stay whole on each rank",
    "fsdp2_tp_loss_parallel": "the LM head and its logits stay whole on each tensor-parallel rank",
    "disable_fsdp2_ckpt": "checkpoints always hold the FSDP2 shards and optimizer state needed to resume",
}
