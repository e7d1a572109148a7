"""The `rlhfkit` console command: `rlhfkit <command> [flags]` dispatches to `python -m rlhfkit.cli.<command>`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": ("demo", "build the tiny offline assets and run the demo pipeline"),
    "demo-assets": ("demo_assets", "write the embedded tokenizer, tiny model and datasets to a directory"),
    "train_sft": ("train_sft", "supervised fine-tuning"),
    "train_rm": ("train_rm", "reward-model training"),
    "train_dpo": ("train_dpo", "DPO / IPO / cDPO"),
    "train_kto": ("train_kto", "KTO"),
    "train_ppo": ("train_ppo", "online RL (PPO, REINFORCE++, GRPO, RLOO) in one process"),
    "train_ppo_ray": ("train_ppo_ray", "online RL with Ray roles and rollout engines"),
    "serve_rm": ("serve_rm", "HTTP server for a reward model"),
    "serve_teacher": ("serve_teacher", "HTTP server for an on-policy distillation teacher (--teacher_url)"),
    "batch_inference": ("batch_inference", "generate / score a dataset; best-of-N, conditional SFT and DPO data"),
    "lora_combiner": ("lora_combiner", "merge a LoRA adapter into its base model"),
    "interactive_chat": ("interactive_chat", "chat with a saved model in the terminal"),
    "report": ("report", "write the HTML report of a run directory"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in COMMANDS.items()
            if importlib.util.find_spec(f"rlhfkit.cli.{spec[0]}") is not None}


def usage() -> str:
    lines = ["usage: rlhfkit <command> [flags]   (rlhfkit <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<17} {text}" for name, (_, text) in _available().items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    available = _available()
    name = args[0].replace("_", "-") if args[0].replace("_", "-") in available else args[0]
    if name not in available:
        sys.stderr.write(f"rlhfkit: error: unknown command {args[0]!r}; one of: {', '.join(available)}\n")
        return 2
    module = importlib.import_module(f"rlhfkit.cli.{available[name][0]}")
    from rlhfkit.cli.common import run_cli

    return run_cli(module.main, args[1:], prog=f"rlhfkit {name}")


if __name__ == "__main__":
    sys.exit(main())
