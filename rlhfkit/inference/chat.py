"""A multi-turn conversation with a saved causal LM, streamed token by token (`rlhfkit.cli.interactive_chat`).

History formats:
- chat template (`apply_chat_template`): the messages so far (an optional system message, then user/assistant
  turns) rendered with the generation prompt;
- plain template: the text of the turns so far, each `template(user) + response` and a newline, then
  `template(user)` of the new turn (the form of the demo and OpenRLHF's `--input_template`).
The prompt is bos + that text; when it is longer than `max_len - max_new_tokens` its oldest tokens are dropped.
Responses stream through Transformers' `TextIteratorStreamer` while `generate` runs in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from rlhfkit.data.templates import apply_input_template, check_input_template, render_chat, setup_chat_template
from rlhfkit.data.tokens import encode, with_bos

DEFAULT_TEMPLATE = "User: {}\nAssistant: "


class ChatSession:
    """Holds the conversation; `reply(text)` yields the response in pieces and then records the turn."""

    def __init__(self, model: Any, tokenizer: Any, *, apply_chat_template: bool = False,
                 input_template: str | None = None, system_prompt: str = "", condition: str = "",
                 max_len: int = 4096, max_new_tokens: int = 512, sampling: dict[str, Any] | None = None):
        if apply_chat_template and input_template:
            raise ValueError("a chat session formats turns with the chat template or an input template, not both")
        if max_new_tokens < 1 or max_len <= max_new_tokens:
            raise ValueError(f"max_len ({max_len}) must exceed max_new_tokens ({max_new_tokens}, >= 1)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = apply_chat_template
        if self.chat:
            setup_chat_template(tokenizer, True)
        self.template = check_input_template(input_template) or DEFAULT_TEMPLATE
        self.system_prompt = system_prompt
        self.condition = condition
        self.max_len = max_len
        self.max_new_tokens = max_new_tokens
        self.sampling = dict(sampling or {"do_sample": False})
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages: list[dict[str, str]] = []
        self.text = ""

    def _user_text(self, text: str) -> str:
        return f"{text} {self.condition.strip()} " if self.condition else text

    def prompt_text(self, user: str) -> str:
        """The text the model continues for a new user turn."""
        if self.chat:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages = system + self.messages + [{"role": "user", "content": self._user_text(user)}]
            return render_chat(self.tokenizer, messages, True, "the conversation")
        start = self.system_prompt if not self.text and self.system_prompt else ""
        return start + self.text + apply_input_template(self.template, self._user_text(user))

    def prompt_ids(self, user: str) -> list[int]:
        ids = with_bos(self.tokenizer, encode(self.tokenizer, self.prompt_text(user)))
        return ids[-(self.max_len - self.max_new_tokens):]

    def reply(self, user: str) -> Iterator[str]:
        """Generate the response to `user`, yielding text as it is decoded; the turn joins the history at the end."""
        from transformers import TextIteratorStreamer

        prompt = self.prompt_text(user)
        ids = torch.tensor([self.prompt_ids(user)], device=next(self.model.parameters()).device)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                      streamer=streamer, pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id, **self.sampling)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.no_grad():
                    self.model.generate(**kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(e)
                streamer.end()

        worker = threading.Thread(target=run, name="chat-generate", daemon=True)
        worker.start()
        pieces = []
        for piece in streamer:
            pieces.append(piece)
            yield piece
        worker.join()
        if errors:
            raise errors[0]
        response = "".join(pieces)
        if self.chat:
            self.messages += [{"role": "user", "content": self._user_text(user)},
                              {"role": "assistant", "content": response}]
        else:
            self.text = prompt + response + "\n"
