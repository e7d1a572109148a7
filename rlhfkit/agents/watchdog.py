"""Bounding the agent's own code where it runs in the engine process: a blocked event loop, a blocking thread.

An agent file's `execute` override (and a tool agent's `step`) runs on the episodes' event loop. Blocking code there
(`time.sleep`, a busy loop, a socket read without a timeout) stops every episode at once, and `asyncio.wait_for`
cannot interrupt it. `LoopWatch.run` therefore runs the loop in a daemon thread and watches a heartbeat task: when
the loop has not beaten for `limit` seconds outside the engine's own generate calls (which block it on purpose),
the loop is given up (`LoopBlocked`): the episodes that finished keep their results, the others fail as timeouts,
and the stuck thread is left behind (a daemon thread: it never keeps the process alive, and it may not call the
engine again). `in_daemon_thread` runs blocking user code (an OpenAI executor's `run_agent` outside a worker) in a
daemon thread and awaits it: unlike `asyncio.to_thread`, whose pool `asyncio.run` joins at shutdown (forever, when
the code blocks), a thread that never returns only costs its episode.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from rlhfkit.agents.api import AgentFailure

BEAT_S = 0.05  # heartbeat period of the watched loop, and how often the watcher looks


class LoopBlocked(Exception):
    """The watched loop did not beat for longer than its limit: user code blocks it."""


class LoopWatch:
    """Run one coroutine on an event loop in a daemon thread; give it up when user code blocks the loop."""

    def __init__(self, limit: float):
        self.limit = float(limit)
        self.beat = time.monotonic()
        self.engine_calls = 0  # engine generate calls in progress: they block the loop, legitimately
        self.abandoned = False

    @contextmanager
    def engine_call(self) -> Iterator[None]:
        """Around the engine's generate call on the loop: not counted as blocking; refused once given up (the
        caller has moved on and may be using the engine)."""
        if self.abandoned:
            raise LoopBlocked("the episodes were given up: their event loop was blocked")
        self.engine_calls += 1
        try:
            yield
        finally:
            self.beat = time.monotonic()  # before the count drops: the watcher must not see the old beat
            self.engine_calls -= 1

    async def _heartbeat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def run(self, main: Coroutine[Any, Any, Any]) -> Any:
        """`asyncio.run(main)` in a daemon thread; its value or exception, or LoopBlocked."""
        box: dict[str, Any] = {}
        done = threading.Event()

        async def watched() -> Any:
            beat = asyncio.get_running_loop().create_task(self._heartbeat())
            try:
                return await main
            finally:
                beat.cancel()

        def target() -> None:
            try:
                box["value"] = asyncio.run(watched())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        self.beat = time.monotonic()
        threading.Thread(target=target, name="agent-episodes", daemon=True).start()
        while not done.wait(BEAT_S):
            stalled = time.monotonic() - self.beat
            if not self.engine_calls and stalled > self.limit:
                self.abandoned = True
                raise LoopBlocked(f"the agent's code blocked the episodes' event loop for more than {self.limit:g} "
                                  "s (a blocking call in execute or step: make it async, or await it in a thread)")
        if "error" in box:
            raise box["error"]
        return box["value"]


def in_daemon_thread(what: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Await `fn(*args)` run in a daemon thread; whatever it raises (SystemExit too) is AgentFailure(exception)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the user's code: its failure costs the episode
            text = str(e).strip()
            error = AgentFailure("exception", f"{what} raised {type(e).__name__}"
                                              + (f": {text.splitlines()[0]}" if text else ""))
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is gone (the episode timed out and the episodes ended)
            pass

    threading.Thread(target=target, name=f"agent-{what}", daemon=True).start()
    return future
