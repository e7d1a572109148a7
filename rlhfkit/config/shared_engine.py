"""Whether a `train_ppo_ray` run's Transformers engine runs inside the actor's process on the actor's own module
(issue 26, Build 1). The rule is stated once, here, on the config layer's specs: the runtime
(`rlhfkit/rl/ray_run.py`, which then builds `rlhfkit.rl.actor_engine.ActorEngine`) and the `--dry_run` planner
(`rlhfkit/planner/engine_rows.py`, which then plans no engine weights and no engine process) both ask
`run_shares_actor_weights(cfg)`.

Sharing is exact when: one actor rank whose module holds the full weights in the engine's dtype (DeepSpeed ZeRO 0-2
or the plain-torch engine, not ZeRO-3 or FSDP2 shards), no LoRA (the engine would need the merged weights), no
4-bit base, no Liger kernels or packed-attention forwards in the actor's module, no --async_train (its generator
actor needs an engine of its own), no image prompts (not yet checked on this path), and the engine colocated with
the actor (--colocate_all_models, one Transformers engine). The rest keeps the separate engine actor;
`RLHFKIT_SHARED_ENGINE=0` forces it (A/B benchmarks, `bench/ray_startup.py`).
"""

from __future__ import annotations

import os

from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.config.specs import RLSpecs

#: "0" keeps the separate Transformers engine actor even where the actor's module could be shared.
SHARED_ENGINE_ENV = "RLHFKIT_SHARED_ENGINE"


def shares_actor_weights(specs: RLSpecs, async_train: bool, image_prompts: bool = False) -> bool:
    """Whether the run's Transformers engine can run inside the actor's process on its module (see above); image
    prompts (a vision-language policy) keep their engine actor for now: not yet measured on this path."""
    actor, engine, placement = specs.actor, specs.engine, specs.placement
    ranks = dict(placement.role_ranks).get("actor", 0)
    return (os.environ.get(SHARED_ENGINE_ENV, "1") != "0" and engine.backend == "transformers"
            and placement.colocate_all and engine.num_engines == 1 and ranks == 1 and not async_train
            and not image_prompts and actor.model.lora_rank == 0 and engine.lora_rank == 0
            and not actor.model.load_in_4bit
            and actor.strategy.backend == "deepspeed" and actor.strategy.zero_stage < 3
            and actor.strategy.ds_tensor_parallel_size == 1 and actor.strategy.ring_attn_size == 1
            and not actor.model.use_liger_kernel and not actor.batch.packed
            and engine.bf16 == actor.model.bf16 and engine.model == actor.model.pretrain)


def run_shares_actor_weights(cfg: PPOConfig, specs: RLSpecs | None = None) -> bool:
    """`shares_actor_weights` for a validated `train_ppo_ray` config (`specs`: its `rl_specs(cfg)`, when the caller
    has them already)."""
    return shares_actor_weights(specs if specs is not None else rl_specs(cfg), cfg.asynchronous.async_train,
                                bool(cfg.vision.image_key))
