"""`python -m rlhfkit.cli.demo_assets --out DIR [--seed N]`: write the offline demo assets and say where they are.

Builds (or reuses, when DIR already holds the same build) a byte-level BPE tokenizer, a random-init tiny Llama
saved together with it, and the demo data sets (SFT, preference pairs, KTO, RL prompts). No network needed.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence

from rlhfkit.errors import UserError

PROG = "rlhfkit.cli.demo_assets"


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors become a UserError (one line, exit code 2) instead of a usage dump."""

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message} (see --help)")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__.strip().splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="Directory to write the assets to (created; reused if it "
                                                "already holds a matching build).")
    p.add_argument("--seed", type=_non_negative, default=0, help="Seed for the tokenizer, model and data.")
    p.add_argument("--n_sft", type=_non_negative, default=4000, help="SFT training records.")
    p.add_argument("--n_eval", type=_non_negative, default=200, help="SFT evaluation records.")
    p.add_argument("--n_pref", type=_non_negative, default=2000, help="Preference pairs for training.")
    p.add_argument("--n_rl", type=_non_negative, default=2000, help="RL training prompts.")
    p.add_argument("--force", action="store_true", help="Rebuild even when a matching build exists.")
    return p


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from rlhfkit.cli.common import quiet_libraries

    quiet_libraries()
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE, build_demo_assets

    assets = build_demo_assets(args.out, seed=args.seed, n_sft=args.n_sft, n_eval=args.n_eval,
                               n_pref=args.n_pref, n_rl=args.n_rl, force=args.force)
    print(f"demo assets (seed {args.seed}) in {assets.root}")
    print(f"  model + tokenizer  {assets.model_dir}   (--pretrain)")
    print(f"  tokenizer          {assets.tokenizer_dir}")
    for split, path in assets.data_files().items():
        print(f"  {split:<18} {path}")
    print(f"  manifest           {assets.manifest}")
    print(f"  prompt template    {DEMO_INPUT_TEMPLATE!r}   (--input_template)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; bad input prints one line on stderr and returns 2."""
    try:
        return _run(argv)
    except UserError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return UserError.exit_code
    except SystemExit as e:  # --help
        return int(e.code or 0)


if __name__ == "__main__":
    sys.exit(main())
