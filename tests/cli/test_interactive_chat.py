"""interactive_chat driven through stdin: each turn's streamed response is the model's greedy continuation of the
conversation so far (computed independently here), and /reset starts the conversation over."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.helpers import REPO

MAX_NEW = 6


def _greedy(model, tokenizer, text: str) -> str:
    """Independent reference: bos + text, greedy `generate`, special tokens dropped from the decoded response."""
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_turns_history_and_reset_through_stdin(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    turns = ["What is 2+3?", "And 4+4?", "/reset", "What is 2+3?", "/exit"]
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli.interactive_chat", "--pretrain",
                           str(demo_assets.model_dir), "--greedy_sampling", "--max_new_tokens", str(MAX_NEW)],
                          input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    banner, *replies = proc.stdout.split(">>> ")
    assert "/reset" in banner and "/exit" in banner
    assert len(replies) == 5 and replies[-1] == ""  # four answered lines, then the prompt /exit was typed at

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32).eval()
    first_prompt = f"User: {turns[0]}\nAssistant: "
    r1 = _greedy(model, tok, first_prompt)
    r2 = _greedy(model, tok, f"{first_prompt}{r1}\nUser: {turns[1]}\nAssistant: ")  # the history is in the prompt
    assert replies[0] == r1 + "\n"
    assert replies[1] == r2 + "\n"
    assert replies[2] == "(conversation cleared)\n"
    assert replies[3] == r1 + "\n"  # after /reset the same question gets the first answer again


def test_bad_input_is_one_line(demo_assets, capsys):
    from rlhfkit.cli.common import run_cli
    from rlhfkit.cli.interactive_chat import main

    for args, message in ((["--pretrain", "/nonexistent"], "--pretrain /nonexistent"),
                          (["--pretrain", str(demo_assets.model_dir), "--apply_chat_template", "--input_template",
                            "Q: {}"], "exclude each other")):
        assert run_cli(main, args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
