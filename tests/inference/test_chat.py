"""ChatSession with a chat template: each prompt is the template's rendering of the conversation so far plus the new
user message; /reset (session.reset) forgets it."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.inference.chat import ChatSession


def test_chat_template_history_and_reset(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32)
    session = ChatSession(model, tok, apply_chat_template=True, max_new_tokens=4, system_prompt="Be brief.")
    first = "".join(session.reply("What is 1+2?"))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"},
                    {"role": "assistant", "content": first}, {"role": "user", "content": "And 2+2?"}]
    assert session.prompt_text("And 2+2?") == tok.apply_chat_template(conversation, tokenize=False,
                                                                      add_generation_prompt=True)
    assert session.prompt_ids("And 2+2?")[0] == tok.bos_token_id
    session.reset()
    assert session.prompt_text("And 2+2?") == tok.apply_chat_template(
        [conversation[0], conversation[-1]], tokenize=False, add_generation_prompt=True)


def test_history_is_cut_from_the_left_to_fit(demo_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32)
    session = ChatSession(model, tok, max_len=12, max_new_tokens=4)
    full = [tok.bos_token_id] + tok.encode("User: " + "word " * 20 + "\nAssistant: ", add_special_tokens=False)
    assert session.prompt_ids("word " * 20) == full[-8:]  # max_len - max_new_tokens newest tokens
    with pytest.raises(ValueError, match="must exceed"):  # the flags were checked when parsed (ChatConfig)
        ChatSession(model, tok, max_len=4, max_new_tokens=4)
