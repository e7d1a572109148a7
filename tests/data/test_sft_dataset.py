"""SFT tokenisation: loss masks checked token by token on the word-level tokenizer of conftest.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlhfkit.data.readers import load_records
from rlhfkit.data.sft_dataset import SFTDataset
from rlhfkit.errors import UserError

from .conftest import ID, ids, make_tokenizer

BOS, EOS = ID["<s>"], ID["</s>"]


def as_lists(sample):
    return sample["input_ids"].tolist(), sample["loss_mask"].tolist()


def test_plain_prompt_response_eos(tok):
    ds = SFTDataset([{"input": "hi", "output": "hello there"}], tok, 64, output_key="output",
                    input_template="user : {} assistant :")
    x, m = as_lists(ds[0])
    assert x == [BOS] + ids("user : hi assistant :") + ids("hello there") + [EOS]
    assert m == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert ds[0]["input_ids"].dtype == ds[0]["loss_mask"].dtype == __import__("torch").long
    assert len(ds) == 1 and ds.num_dropped == 0


def test_bos_not_doubled_and_absent_bos(tok):
    ds = SFTDataset([{"input": "hi", "output": "ok"}], tok, 64, output_key="output", input_template="<s> Q : {} A :")
    assert as_lists(ds[0])[0] == [BOS] + ids("Q : hi A :") + ids("ok") + [EOS]
    no_bos = make_tokenizer(bos=False)
    ds = SFTDataset([{"input": "hi", "output": "ok"}], no_bos, 64, output_key="output")
    assert as_lists(ds[0]) == (ids("hi ok") + [EOS], [0, 1, 1])


def test_chat_single_turn_string_and_messages(tok):
    want_ids = [BOS] + ids("user : hi </s> assistant :") + ids("hello </s>")
    want_mask = [0] * 7 + [1, 1]  # the template's own </s> closes the turn: no extra eos
    ds = SFTDataset([{"q": "hi", "a": "hello"}], tok, 64, input_key="q", output_key="a", apply_chat_template=True)
    assert as_lists(ds[0]) == (want_ids, want_mask)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ds = SFTDataset([{"messages": conversation}], tok, 64, input_key="messages", apply_chat_template=True)
    assert as_lists(ds[0]) == (want_ids, want_mask)
    ds = SFTDataset([{"q": conversation[:1], "a": conversation[1:]}], tok, 64, input_key="q", output_key="a",
                    apply_chat_template=True)
    assert as_lists(ds[0]) == (want_ids, want_mask)


def test_multiturn_masks_exactly_the_assistant_turns(tok):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"},
                    {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "bye"}]
    ds = SFTDataset([{"conversation": conversation}], tok, 64, input_key="conversation", multiturn=True)
    x, m = as_lists(ds[0])
    pieces = [([BOS] + ids("system : be brief </s> user : hi </s> assistant :"), 0), (ids("hello </s>"), 1),
              (ids("user : how are you </s> assistant :"), 0), (ids("fine thanks </s>"), 1)]
    assert x == [t for piece, _ in pieces for t in piece]
    assert m == [flag for piece, flag in pieces for _ in piece]
    targets = [tok.convert_ids_to_tokens(t) for t, keep in zip(x, m) if keep]
    assert targets == ["hello", "</s>", "fine", "thanks", "</s>"]


def test_multiturn_needs_message_list(tok):
    with pytest.raises(UserError, match="record 1: --multiturn needs --input_key 'input' to hold a list"):
        SFTDataset([{"input": "hi"}], tok, 64, multiturn=True)
    with pytest.raises(UserError, match="no record in the dataset has a response to train on"):
        SFTDataset([{"input": [{"role": "user", "content": "hi"}]}], tok, 64, multiturn=True)


def test_pretrain_mode_loss_on_every_token(tok):
    ds = SFTDataset([{"text": "hello there"}], tok, 64, input_key="text", pretrain_mode=True)
    assert as_lists(ds[0]) == ([BOS] + ids("hello there") + [EOS], [0, 1, 1, 1])
    # the raw text, no --input_template (train_sft's default one included), as in OpenRLHF's pretrain mode
    ds = SFTDataset([{"q": "hi ", "a": "ok"}], tok, 64, input_key="q", output_key="a", pretrain_mode=True,
                    input_template="Q : {} A :")
    assert as_lists(ds[0]) == ([BOS] + ids("hi ok") + [EOS], [0] + [1] * 3)


def test_truncation_and_dropping(tok):
    records = [{"input": "hi", "output": "hello there"},  # prompt 6 tokens (with bos), response 3
               {"input": "hi how are you", "output": "fine"}]  # prompt 9 tokens
    ds = SFTDataset(records, tok, 7, output_key="output", input_template="user : {} assistant :")
    assert len(ds) == 1 and ds.num_dropped == 1 and ds.num_dropped_too_long == 1
    assert as_lists(ds[0]) == ([BOS] + ids("user : hi assistant : hello"), [0] * 6 + [1])


def test_max_len_too_small_for_all(tok, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"input": "hi", "output": "ok"}) + "\n" +
                    json.dumps({"input": "hi how are you", "output": "fine"}) + "\n")
    with pytest.raises(UserError) as e:
        SFTDataset(load_records(str(path)), tok, 3, output_key="output", input_template="user : {} assistant :")
    assert str(e.value) == f"--max_len 3 is too small for any sample in {path} (shortest needs 7 tokens)"


def test_missing_key_names_file_and_record(tok, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"input": "hi", "output": "ok"}) + "\n" + json.dumps({"input": "hi", "answer": "x"}))
    with pytest.raises(UserError) as e:
        SFTDataset(load_records(str(path)), tok, 64, output_key="output")
    assert str(e.value) == (f"{path}: record 2 has no key 'output' (its keys: input, answer); set --output_key "
                            "to one of them")
    with pytest.raises(UserError, match="--output_key is required for SFT"):
        SFTDataset([{"input": "hi"}], tok, 64)


def test_from_args(tok):
    args = SimpleNamespace(max_len=64, input_key="q", output_key="a", input_template=None, apply_chat_template=True,
                           tokenizer_chat_template=None, multiturn=False, pretrain_mode=False)
    ds = SFTDataset.from_args([{"q": "hi", "a": "hello"}], tok, args)
    assert as_lists(ds[0])[1] == [0] * 7 + [1, 1]
