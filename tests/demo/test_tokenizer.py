"""The demo tokenizer: single-digit tokens, no implicit bos/eos, chat-template prefix property, offline reload."""

from __future__ import annotations

import json

import pytest

from rlhfkit.demo import tokenizer as tokenizer_module
from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE


def test_special_tokens_have_fixed_ids(demo_tokenizer):
    tok = demo_tokenizer
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(list(tokenizer_module.ROLE_TOKENS)) == [3, 4, 5]
    assert len(tok) == 2048


def test_encoding_adds_no_bos_or_eos(demo_tokenizer):
    ids = demo_tokenizer("What is 12+3?")["input_ids"]
    assert demo_tokenizer.bos_token_id not in ids and demo_tokenizer.eos_token_id not in ids
    assert demo_tokenizer("What is 12+3?", add_special_tokens=True)["input_ids"] == ids


def test_every_digit_is_its_own_token(demo_tokenizer):
    digit_ids = [demo_tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10
    ids = demo_tokenizer("What is 9087+12345?")["input_ids"]
    tokens = demo_tokenizer.convert_ids_to_tokens(ids)
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("908712345")
    assert all(len(t) == 1 for t in tokens if any(c.isdigit() for c in t))


def test_role_markers_are_single_tokens_inside_text(demo_tokenizer):
    ids = demo_tokenizer("<|user|>\nhi\n<|assistant|>\n")["input_ids"]
    assert ids[0] == 4 and 5 in ids


@pytest.mark.parametrize("text", ["What is 73+45?\nAssistant: 118", "Reverse the letters of abcd.",
                                  "  indented\tcode()  \n", "héllo wörld ✓", "<s>a</s>"])
def test_decode_inverts_encode(demo_tokenizer, text):
    assert demo_tokenizer.decode(demo_tokenizer(text)["input_ids"]) == text


def _chat_ids(tok, messages, **kwargs):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def test_chat_template_renders_chatml_like_text(demo_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"},
                {"role": "assistant", "content": "3"}]
    text = demo_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<s><|system|>\nBe brief.\n<|user|>\nWhat is 1+2?\n<|assistant|>\n3</s>"
    prompt = demo_tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.\n<|user|>\nWhat is 1+2?\n<|assistant|>\n"
    ids = _chat_ids(demo_tokenizer, messages)
    assert ids[0] == demo_tokenizer.bos_token_id and ids[-1] == demo_tokenizer.eos_token_id
    assert ids.count(demo_tokenizer.bos_token_id) == 1


def test_chat_template_rejects_unknown_roles(demo_tokenizer):
    with pytest.raises(Exception, match="role must be"):
        demo_tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_generation_prompt_is_a_strict_token_prefix(demo_tokenizer, demo_assets):
    conversations = [json.loads(line)["messages"] for line in demo_assets.sft_train.read_text().splitlines()[:300]]
    conversations += [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " leading space"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nnewline first"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "What is 9+9?"}, {"role": "assistant", "content": "18"}],
    ]
    for messages in conversations:
        full = _chat_ids(demo_tokenizer, messages)
        prompt = _chat_ids(demo_tokenizer, messages[:-1], add_generation_prompt=True)
        assert len(prompt) < len(full) and full[:len(prompt)] == prompt, messages


def test_input_template_prompt_is_a_token_prefix_for_every_task(demo_tokenizer, demo_assets):
    records = [json.loads(line) for line in demo_assets.sft_train.read_text().splitlines()]
    seen_tasks = set()
    for record in records[:600]:
        prompt = DEMO_INPUT_TEMPLATE.format(record["question"])
        prompt_ids = demo_tokenizer(prompt)["input_ids"]
        full_ids = demo_tokenizer(prompt + record["response"])["input_ids"]
        assert full_ids[:len(prompt_ids)] == prompt_ids, record
        seen_tasks.add(record["task"])
    assert seen_tasks == {"addition", "reverse", "max", "count"}


def test_training_is_deterministic_and_seeded():
    a = tokenizer_module.build_tokenizer(seed=3, vocab_size=600)
    b = tokenizer_module.build_tokenizer(seed=3, vocab_size=600)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 600
    assert tokenizer_module.training_corpus(3) != tokenizer_module.training_corpus(4)
