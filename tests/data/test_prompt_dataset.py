"""RL prompts: template or chat template applied, labels carried through."""

from __future__ import annotations

import pytest

from rlhfkit.data.prompt_dataset import PromptDataset
from rlhfkit.errors import UserError


def test_prompts_and_labels(tok):
    records = [{"q": "hi", "answer": 3}, {"q": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "how are you"}], "answer": "fine"}]
    ds = PromptDataset(records, tok, input_key="q", label_key="answer", apply_chat_template=True)
    assert ds[0] == {"prompt": "user : hi </s> assistant : ", "label": 3}
    assert ds[1] == {"prompt": "system : be brief </s> user : how are you </s> assistant : ", "label": "fine"}
    plain = PromptDataset(records[:1], None, input_key="q", input_template="Q : {} A :")
    assert plain[0] == {"prompt": "Q : hi A :", "label": None}


def test_prompt_errors(tok):
    with pytest.raises(UserError, match=r"record 1 has no key 'answer' \(its keys: q\); set --label_key"):
        PromptDataset([{"q": "hi"}], tok, input_key="q", label_key="answer")
    with pytest.raises(UserError, match="--input_template 'Q' has no"):
        PromptDataset([{"q": "hi"}], tok, input_key="q", input_template="Q")
