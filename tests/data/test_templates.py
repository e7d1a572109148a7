"""Record fields, --input_template, chat templates and the conversation segments used for loss masks."""

from __future__ import annotations

import pytest

from rlhfkit.data.readers import Record
from rlhfkit.data.templates import (
    PromptFormatter,
    apply_input_template,
    chat_segments,
    check_input_template,
    get_record_field,
    setup_chat_template,
)
from rlhfkit.errors import UserError

from .conftest import CHAT_TEMPLATE, make_tokenizer


def test_get_record_field_error_names_file_record_and_keys():
    record = {"question": "hi", "answer": "hello"}
    assert get_record_field(record, "answer", "d.jsonl", 4) == "hello"
    with pytest.raises(UserError) as e:
        get_record_field(record, "output", "d.jsonl", 4, flag="--output_key")
    assert str(e.value) == ("d.jsonl: record 5 has no key 'output' (its keys: question, answer); "
                            "set --output_key to one of them")


def test_get_record_field_uses_record_provenance():
    record = Record({"a": 1}, source="x.parquet", index=0)
    with pytest.raises(UserError, match=r"^x.parquet: record 1 has no key 'b' \(its keys: a\)$"):
        get_record_field(record, "b")


def test_input_template():
    assert check_input_template(None) is None
    assert apply_input_template("Q : {} A :", "hi") == "Q : hi A :"
    assert apply_input_template('{"q": {}}', "hi") == '{"q": hi}'  # other braces kept literally
    with pytest.raises(UserError, match=r"--input_template 'User: %s' has no '\{\}'"):
        check_input_template("User: %s")
    with pytest.raises(UserError, match="has no"):
        PromptFormatter(None, input_template="no placeholder")


def test_chat_template_setup(tmp_path):
    tok = make_tokenizer(chat_template=None)
    with pytest.raises(UserError, match="--apply_chat_template: the tokenizer has no chat template"):
        setup_chat_template(tok, True)
    setup_chat_template(tok, True, CHAT_TEMPLATE)
    assert tok.chat_template == CHAT_TEMPLATE
    other = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "t.jinja").write_text(other)
    setup_chat_template(tok, True, str(tmp_path / "t.jinja"))
    assert tok.chat_template == other


def test_prompt_formatter_modes(tok):
    chat = PromptFormatter(tok, apply_chat_template=True)
    assert chat("hi", "r") == "user : hi </s> assistant : "
    assert chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "r") == \
        "system : be brief </s> user : hi </s> assistant : "
    plain = PromptFormatter(tok, input_template="Q : {} A :")
    assert plain("hi", "r") == "Q : hi A :"
    with pytest.raises(UserError, match=r"d.jsonl: record 1: --input_key holds a list \(.*\), not text"):
        plain([{"role": "user", "content": "hi"}], "d.jsonl: record 1")
    with pytest.raises(UserError, match="must be a string or a list of"):
        chat(42, "r")


def test_chat_segments(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    assert chat_segments(tok, messages, "r") == [("user : hi </s> assistant : ", False), ("hello </s> ", True)]


def test_chat_segments_rejects_non_prefix_template():
    tok = make_tokenizer("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{% if loop.last %} ok"
                         "{% endif %} </s> {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(UserError, match="r: the chat template does not render message 2 as an extension"):
        chat_segments(tok, messages, "r")


def test_chat_template_failure_is_user_error():
    tok = make_tokenizer("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(UserError, match="d.json: record 3: the chat template failed.*only user and assistant"):
        PromptFormatter(tok, apply_chat_template=True)("hi", "d.json: record 3")
