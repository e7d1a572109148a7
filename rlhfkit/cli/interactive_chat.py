"""`python -m rlhfkit.cli.interactive_chat --pretrain DIR`: chat with a saved model in the terminal.

Responses stream as they are generated. Commands: /reset (also /clear) forgets the conversation, /exit (also
/quit, or end of input) leaves. The conversation is formatted with the tokenizer's chat template
(--apply_chat_template) or a plain template (--input_template, default $'User: {}\\nAssistant: ').
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.chat import ChatConfig
from rlhfkit.errors import UserError

PROG = "rlhfkit.cli.interactive_chat"
PROMPT = ">>> "
RESET, EXIT = ("/reset", "/clear"), ("/exit", "/quit")


def build_session(cfg: ChatConfig):  # -> ChatSession
    import torch

    from rlhfkit.inference.chat import ChatSession
    from rlhfkit.models.loading import check_model_path, load_causal_lm, load_tokenizer, resolve_attn_implementation

    path = check_model_path(cfg.pretrain)
    system = ""
    if cfg.ta_prompt:
        if not Path(cfg.ta_prompt).is_file():
            raise UserError(f"--ta_prompt {cfg.ta_prompt}: no such file")
        system = Path(cfg.ta_prompt).read_text(encoding="utf-8")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the terminal is the chat's
    tokenizer = load_tokenizer(path, use_fast=not cfg.disable_fast_tokenizer)
    if cfg.tokenizer_chat_template:
        from rlhfkit.data.templates import setup_chat_template

        setup_chat_template(tokenizer, cfg.apply_chat_template, cfg.tokenizer_chat_template)
    model = load_causal_lm(path, attn_implementation=resolve_attn_implementation(cfg.attn_implementation, False),
                           dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()  # type: ignore[call-arg]  # transformers' @wraps(Module.cuda) types away `self`
    greedy = cfg.greedy_sampling or cfg.temperature == 0
    sampling = {"do_sample": not greedy, "repetition_penalty": cfg.repetition_penalty}
    if not greedy:
        sampling.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    torch.manual_seed(cfg.seed)
    return ChatSession(model, tokenizer, apply_chat_template=cfg.apply_chat_template,
                       input_template=cfg.input_template, system_prompt=system,
                       condition=cfg.csft_prompt if cfg.enable_csft else "", max_len=cfg.max_len,
                       max_new_tokens=cfg.max_new_tokens, sampling=sampling)


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(ChatConfig, argv, PROG, __doc__)
    session = build_session(cfg)
    print(f"chatting with {cfg.pretrain}; /reset clears the conversation, /exit quits", flush=True)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            break
        command = line.strip().lower()
        if command in EXIT:
            break
        if command in RESET:
            session.reset()
            print("(conversation cleared)", flush=True)
            continue
        if not line.strip():
            continue
        for piece in session.reply(line):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
