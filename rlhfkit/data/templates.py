"""Turning records into prompt text: record fields, `--input_template`, and chat templates.

Chat-templated conversations are split into segments (text, is_assistant) by rendering successive prefixes of
the message list, so that loss masks can mark exactly the assistant turns whatever the template looks like.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhfkit.errors import UserError

Messages = list[dict[str, Any]]


def where_of(record: Any, path: str | None = None, index: int | None = None) -> str:
    """`file: record N` (1-based) for error messages; falls back to what the record knows about itself."""
    path = path if path is not None else getattr(record, "source", None)
    index = index if index is not None else getattr(record, "index", None)
    if path is None and index is None:
        return "a record"
    number = f"record {index + 1}" if index is not None else "a record"
    return f"{path}: {number}" if path is not None else number


def locate(record: Any, position: int) -> str:
    """`where_of` for the record at `position` of a list: a Record's own source and index win."""
    return where_of(record, index=None if hasattr(record, "index") else position)


def get_record_field(record: Any, key: str | None, path: str | None = None, index: int | None = None,
                     flag: str | None = None) -> Any:
    """record[key], or a UserError naming the file, the record (1-based) and the keys the record has."""
    return require_field(record, key, where_of(record, path, index), flag)


def require_field(record: Any, key: str | None, where: str, flag: str | None = None) -> Any:
    """record[key]; `where` ("file: record N") starts the error message when the key is missing."""
    if key is None:
        raise UserError(f"{flag or 'a record key'} is not set; {where} has keys {_keys(record)}")
    if not isinstance(record, dict) or key not in record:
        hint = f"; set {flag} to one of them" if flag else ""
        raise UserError(f"{where} has no key '{key}' (its keys: {_keys(record)}){hint}")
    return record[key]


def _keys(record: Any) -> str:
    return ", ".join(str(k) for k in record) if isinstance(record, dict) else f"none, it is a {type(record).__name__}"


# -- --input_template ---------------------------------------------------------------------------------------
def check_input_template(template: str | None, flag: str = "--input_template") -> str | None:
    """Fail fast on a template without the `{}` that marks where the prompt goes; '' is no template (as in
    OpenRLHF, where it turns off train_sft's default template)."""
    if not template:
        return None
    if "{}" not in template:
        raise UserError(f"{flag} {template!r} has no '{{}}' to mark where the prompt goes, e.g. "
                        "$'User: {}\\nAssistant: '")
    return template


def apply_input_template(template: str | None, text: str) -> str:
    """Put `text` where `{}` is; other braces are kept as they are (no str.format escaping needed)."""
    return text if not template else template.replace("{}", text)


# -- chat templates -----------------------------------------------------------------------------------------
def setup_chat_template(tokenizer: Any, apply_chat_template: bool, tokenizer_chat_template: str | None = None) -> None:
    """Install `--tokenizer_chat_template` (Jinja text, or a file holding it) on the tokenizer, and check that a
    template exists when `--apply_chat_template` is on. The override is kept on the tokenizer, so it is saved
    with the trained model."""
    if tokenizer_chat_template:
        path = Path(tokenizer_chat_template).expanduser()
        is_file = "{" not in tokenizer_chat_template and path.is_file()
        tokenizer.chat_template = path.read_text(encoding="utf-8") if is_file else tokenizer_chat_template
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("--apply_chat_template: the tokenizer has no chat template; give one with "
                        "--tokenizer_chat_template or use --input_template")


#: Message roles chat templates know; anything else is a typo in the data, not a new speaker.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def as_messages(value: Any, role: str, where: str, flag: str) -> Messages:
    """A string becomes one message with `role`; a message list is checked (dicts with a known role and text
    content)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    messages = [value] if isinstance(value, dict) else value
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError(f"{where}: {flag} must be a string or a list of {{'role': ..., 'content': ...}} messages; "
                        f"got {_short(value)}")
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise UserError(f"{where}: {flag} message {i} is {describe(m)}, not a {{'role': ..., 'content': ...}} "
                            "object")
        if m.get("role") not in CHAT_ROLES:
            raise UserError(f"{where}: {flag} message {i} has role {m.get('role')!r}; use one of "
                            f"{', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            got = "no 'content'" if "content" not in m else f"content {describe(m['content'])}"
            raise UserError(f"{where}: {flag} message {i} ({m['role']}) has {got}; give it its text as 'content'")
    return list(messages)


def describe(value: Any) -> str:
    """`null`, `a number (5)`, `a list ([...])`: what a record field holds, for error messages."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
            str: "a string"}.get(type(value), f"a {type(value).__name__}")
    return f"{kind} ({_short(value)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def render_chat(tokenizer: Any, messages: Messages, add_generation_prompt: bool, where: str) -> str:
    """The chat template applied to `messages`, as text."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 -- Jinja errors (raise_exception, bad roles) are about the data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{where}: the chat template failed on these messages: {first}") from None
    if not isinstance(text, str):
        raise UserError(f"{where}: the chat template did not render text (got {type(text).__name__})")
    return text


def chat_segments(tokenizer: Any, messages: Messages, where: str,
                  loss_roles: Sequence[str] = ("assistant",)) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_target) segments, one pair per assistant turn.

    For the assistant message i: the text before it is render(messages[:i], generation prompt) and its own text
    is what render(messages[:i+1]) adds to that. Each render must extend the previous one (true for ordinary
    templates); messages after the last assistant turn are left out, since no loss would fall on them.
    """
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") not in loss_roles:
            continue
        prompt = render_chat(tokenizer, messages[:i], True, where) if i else ""
        full = render_chat(tokenizer, messages[: i + 1], False, where)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise UserError(f"{where}: the chat template does not render message {i + 1} as an extension of the "
                            "messages before it, so the assistant tokens cannot be located; use a template whose "
                            "rendering of a conversation prefix is a prefix of the whole rendering")
        segments.append((prompt[len(done):], False))
        segments.append((full[len(prompt):], True))
        done = full
    return segments


def prompt_and_response(tokenizer: Any, prompt_messages: Messages, response_messages: Messages,
                        where: str) -> tuple[str, str]:
    """Single turn: (prompt text with the generation prompt, the text the response messages add)."""
    prompt = render_chat(tokenizer, prompt_messages, True, where)
    full = render_chat(tokenizer, prompt_messages + response_messages, False, where)
    if not full.startswith(prompt):
        raise UserError(f"{where}: the chat template's generation prompt is not a prefix of the rendered "
                        "conversation, so the response tokens cannot be located")
    return prompt, full[len(prompt):]


class PromptFormatter:
    """Prompt text for one record field: chat template (with generation prompt), `--input_template`, or as is."""

    def __init__(self, tokenizer: Any = None, input_template: str | None = None, apply_chat_template: bool = False,
                 tokenizer_chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.input_template = check_input_template(input_template)
        self.apply_chat_template = apply_chat_template
        if apply_chat_template or tokenizer_chat_template:
            if tokenizer is None:
                raise UserError("--apply_chat_template needs a tokenizer (give --pretrain)")
            setup_chat_template(tokenizer, apply_chat_template, tokenizer_chat_template)

    def messages(self, value: Any, where: str, flag: str = "--input_key") -> Messages:
        return as_messages(value, "user", where, flag)

    def __call__(self, value: Any, where: str, flag: str = "--input_key") -> str:
        if self.apply_chat_template:
            return render_chat(self.tokenizer, self.messages(value, where, flag), True, where)
        if not isinstance(value, str):
            raise UserError(f"{where}: {flag} holds {describe(value)}, not text; fix the record (or, for message "
                            "lists, pass --apply_chat_template)")
        return apply_input_template(self.input_template, value)
