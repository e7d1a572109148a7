"""The SFT masks on a realistic tokenizer: byte-level BPE with a ChatML template (end token = eos, no bos).

The ids must decode back to exactly the rendered conversation, and the target tokens to exactly the assistant
turns (their <|im_end|> and newline included), whatever merges BPE would make across segment boundaries.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhfkit.data.collate import pad_collate
from rlhfkit.data.sft_dataset import SFTDataset

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["what is two plus two", "two plus two is four", "hello there, how are you today?",
        "I am fine, thanks for asking.", "the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="module")
def chatml():
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(TEXT, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def test_multiturn_round_trip(chatml):
    conversation = [{"role": "user", "content": "what is two plus two"},
                    {"role": "assistant", "content": "two plus two is four"},
                    {"role": "user", "content": "hello there, how are you today?"},
                    {"role": "assistant", "content": "I am fine, thanks for asking."}]
    ds = SFTDataset([{"messages": conversation}], chatml, 512, input_key="messages", multiturn=True)
    x, m = ds[0]["input_ids"].tolist(), ds[0]["loss_mask"].tolist()
    assert chatml.decode(x) == chatml.apply_chat_template(conversation, tokenize=False)
    assert x[0] != chatml.bos_token_id or chatml.bos_token_id is None  # no bos token: none added
    runs, current = [], []
    for t, keep in zip(x, m):
        if keep:
            current.append(t)
        elif current:
            runs.append(chatml.decode(current))
            current = []
    runs.append(chatml.decode(current))
    assert runs == ["two plus two is four<|im_end|>\n", "I am fine, thanks for asking.<|im_end|>\n"]


def test_single_turn_and_truncated_batch(chatml):
    records = [{"q": "what is two plus two", "a": "four"}, {"q": "hello there", "a": "I am fine"}]
    ds = SFTDataset(records, chatml, 512, input_key="q", output_key="a", apply_chat_template=True)
    first = ds[0]
    targets = first["input_ids"][first["loss_mask"].bool()].tolist()
    assert chatml.decode(targets) == "four<|im_end|>\n"  # eos already closes the turn: not appended again
    batch = pad_collate([ds[0], ds[1]], chatml.pad_token_id)
    assert batch["input_ids"].shape[0] == 2
    assert batch["loss_mask"].sum().item() == sum(int(s["loss_mask"].sum()) for s in (ds[0], ds[1]))
