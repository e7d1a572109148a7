"""Config of `rlhfkit.cli.interactive_chat` (OpenRLHF's interactive_chat flags)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.base import arg
from rlhfkit.errors import UserError


@dataclass
class ChatConfig:
    pretrain: str | None = arg(None, "Model directory to chat with (any saved causal LM).")
    bf16: bool = arg(False, "Run the model in bfloat16.")
    attn_implementation: str = arg("sdpa", "Attention kernel.", choices=("sdpa", "eager", "flash_attention_2"))
    disable_fast_tokenizer: bool = arg(False, "Load the slow (Python) tokenizer.")
    max_len: int = arg(4096, "Most tokens of history + response; the oldest history tokens are dropped to fit.")
    max_new_tokens: int = arg(512, "Most tokens of one response.")
    greedy_sampling: bool = arg(False, "Decode greedily.")
    temperature: float = arg(0.2, "Sampling temperature.")
    top_p: float = arg(0.9, "Nucleus sampling: sample from the smallest token set with this much probability.")
    repetition_penalty: float = arg(1.0, "Divide the logits of tokens already in the context (1.0: off).")
    seed: int = arg(42, "Sampling seed.")
    input_template: str | None = arg(None, "Plain template of one user turn, '{}' marks where (default "
                                           "$'User: {}\\nAssistant: '); not with --apply_chat_template.")
    apply_chat_template: bool = arg(False, "Format the conversation with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = arg(None, "A Jinja chat template that replaces the tokenizer's.")
    ta_prompt: str | None = arg(None, "A file whose text starts every conversation (a system message with "
                                      "--apply_chat_template).")
    enable_csft: bool = arg(False, "Conditional SFT: add --csft_prompt after every user message.")
    csft_prompt: str = arg("<rm_score>: 5.00", "The condition added with --enable_csft.")

    def validate(self) -> None:
        """Every flag rule (UserError, one line); whether --pretrain and --ta_prompt exist is checked on load."""
        if self.apply_chat_template and self.input_template:
            raise UserError("--input_template and --apply_chat_template exclude each other; pass one")
        if self.tokenizer_chat_template and not self.apply_chat_template:
            raise UserError("--tokenizer_chat_template needs --apply_chat_template (it replaces the template that "
                            "flag uses)")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise UserError("--temperature must be >= 0, --top_p in (0, 1] and --repetition_penalty > 0")
        if self.max_new_tokens < 1 or self.max_len <= self.max_new_tokens:
            raise UserError(f"--max_len {self.max_len} must exceed --max_new_tokens {self.max_new_tokens} (>= 1)")
