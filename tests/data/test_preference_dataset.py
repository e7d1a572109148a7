"""Preference pairs and KTO samples: text forms, shared chat prefix, truncation, margins and labels."""

from __future__ import annotations

import pytest

from rlhfkit.data.preference_dataset import PreferenceDataset, UnpairedDataset
from rlhfkit.errors import UserError

from .conftest import ID, ids

BOS = ID["<s>"]


def parts(sample, *keys):
    return [sample[k].tolist() for k in keys]


def test_plain_pairs_with_template(tok):
    ds = PreferenceDataset([{"q": "hi", "chosen": "hello", "rejected": "bad"}], tok, 64, prompt_key="q",
                           input_template="Q : {} A :")
    assert parts(ds[0], "prompt_ids", "chosen_ids", "rejected_ids") == \
        [[BOS] + ids("Q : hi A :"), ids("hello </s>"), ids("bad </s>")]
    assert ds[0]["margin"] == 0.0
    no_prompt = PreferenceDataset([{"chosen": "hello", "rejected": "bad"}], tok, 64)
    assert parts(no_prompt[0], "prompt_ids", "chosen_ids") == [[BOS], ids("hello </s>")]


def test_chat_pairs_shared_prefix(tok):
    user = {"role": "user", "content": "hi"}
    record = {"chosen": [user, {"role": "assistant", "content": "hello"}],
              "rejected": [user, {"role": "assistant", "content": "bad"}]}
    ds = PreferenceDataset([record], tok, 64, apply_chat_template=True)
    want = [[BOS] + ids("user : hi </s> assistant :"), ids("hello </s>"), ids("bad </s>")]
    assert parts(ds[0], "prompt_ids", "chosen_ids", "rejected_ids") == want
    with_prompt = PreferenceDataset([{"p": "hi", "c": "hello", "r": "bad"}], tok, 64, prompt_key="p",
                                    chosen_key="c", rejected_key="r", apply_chat_template=True)
    assert parts(with_prompt[0], "prompt_ids", "chosen_ids", "rejected_ids") == want
    record["rejected"] = [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "bad"}]
    with pytest.raises(UserError, match="record 1: the responses do not share the same prompt messages"):
        PreferenceDataset([record], tok, 64, apply_chat_template=True)


def test_message_lists_need_chat_template(tok):
    record = {"chosen": [{"role": "assistant", "content": "hello"}], "rejected": "bad"}
    with pytest.raises(UserError, match=r"--chosen_key holds a list \(.*\), not text; .*pass --apply_chat_template"):
        PreferenceDataset([record], tok, 64)


def test_pair_truncation_and_all_dropped(tok):
    records = [{"p": "hi", "c": "hello there", "r": "bad"}, {"p": "how are you", "c": "fine", "r": "bad"}]
    ds = PreferenceDataset(records, tok, 3, prompt_key="p", chosen_key="c", rejected_key="r")
    assert len(ds) == 1 and ds.num_dropped == 1
    assert parts(ds[0], "prompt_ids", "chosen_ids", "rejected_ids") == [[BOS, ID["hi"]], [ID["hello"]], [ID["bad"]]]
    with pytest.raises(UserError, match=r"^--max_len 2 is too small for any sample in the dataset "
                                        r"\(shortest needs 3 tokens\)$"):
        PreferenceDataset(records, tok, 2, prompt_key="p", chosen_key="c", rejected_key="r")


def test_missing_keys_and_bad_margin(tok):
    with pytest.raises(UserError, match=r"record 1 has no key 'rejected' \(its keys: chosen, other\)"):
        PreferenceDataset([{"chosen": "ok", "other": "bad"}], tok, 64)
    with pytest.raises(UserError, match="record 1: --margin_key holds 'big', not a number"):
        PreferenceDataset([{"chosen": "ok", "rejected": "bad", "m": "big"}], tok, 64, margin_key="m")


def test_unpaired_labels(tok):
    records = [{"input": "hi", "output": "hello", "label": v} for v in (True, 0, "yes", "False", 1.0)]
    ds = UnpairedDataset(records, tok, 64)
    assert [s["label"] for s in ds.samples] == [1, 0, 1, 0, 1]
    assert parts(ds[0], "prompt_ids", "response_ids") == [[BOS, ID["hi"]], ids("hello </s>")]
    with pytest.raises(UserError, match="record 1: --label_key holds 'maybe'; KTO labels are true/false"):
        UnpairedDataset([{"input": "hi", "output": "ok", "label": "maybe"}], tok, 64)


def test_identical_chosen_and_rejected_is_an_error_naming_the_record(tok):
    pairs = [{"q": "hi", "chosen": "a", "rejected": "b"}, {"q": "hi", "chosen": "same", "rejected": "same"}]
    with pytest.raises(UserError, match=r"record 2: the 'chosen' and 'rejected' responses are identical"):
        PreferenceDataset(pairs, tok, 64, prompt_key="q")
