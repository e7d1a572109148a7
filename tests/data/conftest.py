"""A tiny word-level tokenizer with <s>, </s>, <pad> and a Jinja chat template, built offline in milliseconds.

Words are split on whitespace and punctuation, so token boundaries are obvious and loss masks can be checked
by hand: ids are the positions in WORDS.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", "system", ":", "hi", "hello", "there", "how",
         "are", "you", "fine", "thanks", "bye", "ok", "good", "bad", "Q", "A", "be", "brief"]
ID = {w: i for i, w in enumerate(WORDS)}
# "<role> : <content> </s>" per message; the generation prompt is "assistant :".
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def ids(text: str) -> list[int]:
    """Hand-written expectation: the ids of space-separated words."""
    return [ID[w] for w in text.split()]


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE, bos: bool = True) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(dict(ID), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>" if bos else None, eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


@pytest.fixture
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()
