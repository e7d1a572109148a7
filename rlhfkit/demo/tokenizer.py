"""The demo tokenizer: a small byte-level BPE trained offline on text that ships with Python plus task text.

Properties the rest of rlhfkit relies on:
- It never adds special tokens by itself: `tokenizer("x")` has no `<s>`/`</s>`. Callers put bos/eos in
  explicitly (the chat template writes `<s>` and the `</s>` after each assistant turn).
- Every digit is its own token, so "123" is three tokens and the model can learn column-wise addition.
- Every whitespace character is its own pre-token, so a word never absorbs the space before it. A prompt
  that ends in whitespace ("User: ...\\nAssistant: ") is therefore a token prefix of prompt + response, for
  any response: the data layer can find where the response starts by tokenising the prompt alone.
- The chat template is ChatML-like: `<s>`, then `<|user|>\\n{content}\\n` (and `<|system|>`),
  `<|assistant|>\\n{content}</s>`; `add_generation_prompt` appends `<|assistant|>\\n`. With the last message
  from the assistant, the generation-prompt rendering of the other messages is a strict token prefix of the
  full rendering.
"""

from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhfkit.demo import tasks

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..5, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo chat template: role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Modules whose docstrings join `pydoc_data.topics` as English/code text. A fixed list keeps the corpus the
# same from run to run (it still changes with the Python version, which the asset manifest records).
_DOC_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gzip",
    "heapq", "html", "http.client", "inspect", "io", "itertools", "json", "logging", "math", "operator", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil", "socket", "sqlite3",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "tokenize", "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)
_DOC_CHARS = 550_000
_TASK_LINES = 6_000


def _pydoc_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


_DOCSTRINGS_SCRIPT = """
import importlib, inspect, json, sys
names, limit = json.loads(sys.argv[1]), int(sys.argv[2])
out, total = [], 0
for name in names:
    try:
        module = importlib.import_module(name)
    except ImportError:
        continue
    objects = [module] + [getattr(module, attr) for attr in sorted(vars(module)) if not attr.startswith("_")]
    for obj in objects:
        if obj is not module and getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = inspect.getdoc(obj) if inspect.ismodule(obj) or callable(obj) else None
        if doc:
            out.append(doc)
            total += len(doc)
            if total >= limit:
                break
    if total >= limit:
        break
json.dump(out, sys.stdout)
"""


def _docstring_text(limit: int) -> list[str]:
    """Docstrings of `_DOC_MODULES` and their public members, in a fixed order, up to `limit` characters.

    Read in a fresh, isolated interpreter (`python -I`): libraries imported in this process may patch stdlib
    functions (one replaces `inspect.getsourcefile`), which would change the text, and with it the tokenizer,
    depending on what ran before. Re-exports and constants are skipped (they would repeat other modules' text)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-I", "-c", _DOCSTRINGS_SCRIPT, json.dumps(_DOC_MODULES), str(limit)],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


def _task_text(seed: int, n_lines: int) -> list[str]:
    """Demo-format lines (plain template and chat form) so the task vocabulary gets merges of its own."""
    rng = random.Random(f"rlhfkit-demo-tokenizer-{seed}")
    lines = []
    for i in range(n_lines):
        p = tasks.make_problem(tasks.sample_task(rng), rng)
        if i % 2:
            lines.append(f"User: {p['prompt']}\nAssistant: {p['answer']}")
        else:
            lines.append(f"<|user|>\n{p['prompt']}\n<|assistant|>\n{p['answer']}")
    return lines


def training_corpus(seed: int = 0) -> list[str]:
    """The texts the BPE is trained on, in a fixed order (about 1 MB)."""
    return _pydoc_text() + _docstring_text(_DOC_CHARS) + _task_text(seed, _TASK_LINES)


def _train_bpe(corpus: list[str], vocab_size: int) -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return bpe


def build_tokenizer(seed: int = 0, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train the demo tokenizer (about 1 s) and wrap it for Transformers. Same seed -> same token ids.

    Encoding adds no bos/eos (`add_bos_token=False`, `add_eos_token=False`): callers add them. Save it with
    `save_pretrained(dir)`; `AutoTokenizer.from_pretrained(dir)` loads it back offline.
    """
    if vocab_size < 512:
        raise ValueError(f"demo tokenizer vocab_size {vocab_size} is too small: use at least 512")
    bpe = _train_bpe(training_corpus(seed), vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS),
        add_bos_token=False,
        add_eos_token=False,
        padding_side="right",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
