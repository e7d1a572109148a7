"""Rollout generation: rlhfkit's Transformers engine (`HFRolloutEngine.generate`, the single-process GRPO engine) vs
the generation TRL 1.16.0's GRPOTrainer runs without vLLM (`model.generate(do_sample=True)` on left-padded prompts,
a GenerationConfig like TRL's).

128 prompts (16 demo prompts x 8), at most 32 new tokens, temperature 1, no top-k / top-p, fp32, one batch. rlhfkit's
engine also returns each sampled token's log-prob; `generate` returns tokens only. Time per call (median after a
warm-up call) and generated tokens per call.

    .venv/bin/python bench/generate.py [--case 25m] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import machine_limit
from common import StepClock, build_models, count_params, interleaved, load, parent_args, table, write_section

PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 32
CALLS = 6
CASES = {"tiny": "tiny", "25m": "25m"}


def prompt_ids(tokenizer, assets) -> list[list[int]]:
    from rlhfkit.data.tokens import encode, with_bos

    records = assets.read("rl_train")[:PROMPTS]
    return [with_bos(tokenizer, encode(tokenizer, f"User: {r['prompt']}\nAssistant: "))
            for r in records for _ in range(SAMPLES)]


def child_rlhfkit(model_dir: Path, prompts: list[list[int]]) -> StepClock:
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine.from_pretrained(str(model_dir), AutoTokenizer.from_pretrained(model_dir),
                                             dtype=torch.float32)
    clock = StepClock()
    tokens = []
    for call in range(CALLS):
        out = engine.generate(prompts, max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, seed=call)
        clock.tick()
        tokens.append(sum(len(s.response_ids) for s in out))
    clock.extra["tokens_per_call"] = statistics.mean(tokens)
    return clock


def child_trl(model_dir: Path, prompts: list[list[int]]) -> StepClock:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=tok.pad_token_id,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, temperature=1.0,
                              top_p=1.0, top_k=None, repetition_penalty=1.0)
    clock = StepClock()
    tokens = []
    for call in range(CALLS):
        torch.manual_seed(call)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        clock.tick()
        new = out[:, width:]
        tokens.append(int((new != tok.pad_token_id).sum()))
    clock.extra["tokens_per_call"] = statistics.mean(tokens)
    return clock


def bandwidth_ceiling(limit: machine_limit.Limit, model_dir: Path) -> float:
    """Generated tokens per second if each decode step only had to read the fp32 weights once."""
    shape = machine_limit.model_shape(machine_limit.config_of(model_dir))
    return PROMPTS * SAMPLES * limit.bandwidth() / (4 * shape.matmul_params)


def main() -> None:
    args = parent_args(__doc__, list(CASES))
    workdir = Path(args.workdir).resolve()
    if args.child:
        from transformers import AutoTokenizer

        assets, models = build_models(workdir)
        model_dir = models[CASES[args.case[0]]]
        prompts = prompt_ids(AutoTokenizer.from_pretrained(model_dir), assets)
        run = child_rlhfkit if args.child == "rlhfkit" else child_trl
        run(model_dir, prompts).report()
        return
    started_load = load()
    from transformers import AutoTokenizer

    assets, models = build_models(workdir)
    cases = args.case or list(CASES)
    results = interleaved(Path(__file__), cases, args.repeats, args.threads, warmup=1)
    sizes = {name: count_params(path) / 1e6 for name, path in models.items()}
    limit = machine_limit.Limit(models, args.threads)
    lengths = {case: [len(p) for p in prompt_ids(AutoTokenizer.from_pretrained(models[CASES[case]]), assets)]
               [::SAMPLES] for case in cases}

    def floor(case: str, system: str, extra: dict) -> float:  # each system's own generated tokens
        new = extra["tokens_per_call"] / (PROMPTS * SAMPLES)
        return limit.generation_floor(CASES[case], lengths[case], SAMPLES, new)

    lines = table(results, unit="s/call", describe=lambda case: f"{case} ({sizes[CASES[case]]:.1f}M)",
                  floor=floor, threads=args.threads)
    lines = [line.replace("TRL median", "TRL path (generate) median") for line in lines]
    lines += ["", "Generated tokens per call: " + "; ".join(
        f"{case}: rlhfkit {r['rlhfkit']['extra']['tokens_per_call']:.0f}, generate "
        f"{r['trl']['extra']['tokens_per_call']:.0f}" for case, r in results.items())]
    lines += ["", "Decode tokens/s against the bandwidth floor (fp32 weights read once per decode step of "
              f"{PROMPTS * SAMPLES} sequences, at the triad bandwidth): " + "; ".join(
                  f"{case}: ceiling {bandwidth_ceiling(limit, models[CASES[case]]):,.0f} tok/s, " + ", ".join(
                      f"{s} {r[s]['extra']['tokens_per_call'] / statistics.median(r[s]['times']):,.0f} tok/s (on CPU "
                      f"time {r[s]['extra']['tokens_per_call'] * args.threads / statistics.median(r[s]['cpu']):,.0f})"
                      for s in r) for case, r in results.items()), "", limit.describe()]
    settings = (f"Settings: {PROMPTS * SAMPLES} prompts in one batch, at most {NEW_TOKENS} new tokens, temperature 1, "
                f"fp32, {args.threads} torch threads per process, {args.repeats} interleaved runs per system, "
                f"{CALLS} calls per run (first one warm-up).")
    path = write_section("generate", "Rollout generation", lines, started_load, settings,
                         Path(args.results) if args.results else None)
    print(f"results: {path}")
    print(json.dumps({case: {s: statistics.median(r[s]["times"]) for s in r} for case, r in results.items()}))


if __name__ == "__main__":
    main()
