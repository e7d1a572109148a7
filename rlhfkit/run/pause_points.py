"""Test hook: pause a run at a named point so a test can SIGKILL it (or a part of it) there deterministically.

`RLHFKIT_TEST_PAUSE=<point>@<step>:<file>` makes rank 0 write its pid to `<file>` and sleep when it reaches
`<point>` at `<step>`, until the test deletes `<file>` (then the run goes on) or 600 s pass. Points: `between`
(step <step> finished, logged and checkpointed; the next not begun), `mid` (inside step <step>: the first micro
batch or the rollout done, the update not), `ckpt` (checkpoint of <step> fully written under `.incomplete/` but not
yet renamed into place). Unset (always, outside tests): a no-op.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

ENV = "RLHFKIT_TEST_PAUSE"
T = TypeVar("T")


def pause_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("RANK", "0") != "0":
        return
    where, _, flag = spec.partition(":")
    if where == f"{point}@{step}":
        path = Path(flag)
        path.write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while path.exists() and time.monotonic() < deadline:  # a test may kill a part of the run meanwhile
            time.sleep(0.05)


class PausingList(list):
    """A list whose iteration pauses at `mid@step` once the first item has been used (the caller asks for the next
    one); `len` and indexing are a plain list's, so the trainers can size the step by it."""

    def __init__(self, items: Iterable[T], step: int):
        super().__init__(items)
        self.step = step

    def __iter__(self) -> Iterator[T]:
        for i, item in enumerate(list.__iter__(self)):
            if i == 1:
                pause_point("mid", self.step)
            yield item
        if os.environ.get(ENV):
            pause_point("mid", self.step)  # a single micro batch: its work is done, the step's bookkeeping is not


def pausing_after_first(items: Iterable[T], step: int) -> PausingList:
    """`items` as a list that pauses at `mid@step` after its first item (see PausingList)."""
    return PausingList(items, step)
