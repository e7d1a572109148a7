"""The reward server's scoring worker: one thread owns the model and fills each forward pass fairly.

The worker fills each forward pass of up to `batch_size` queries round-robin from every waiting request (waiting
at most `wait_s` for more), so the model is only ever used by one thread and a request with thousands of queries
is scored in chunks that interleave with small requests instead of blocking them until it is done. A request
that times out is cancelled: the worker drops its queries not yet scored.

Requests reach the worker as `Job`s from any thread; the worker calls `job.finish()` once per job, which runs the
job's `on_done` callback on the worker thread (the HTTP server uses it to wake its event loop).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhfkit.rewards.scorer import RewardScorer


def _nothing() -> None:
    pass


@dataclass
class Job:
    texts: list[str]
    on_done: Callable[[], None] = _nothing
    rewards: list[float] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False
    finished: bool = False

    @property
    def pending(self) -> int:
        return len(self.texts) - len(self.rewards)

    def finish(self, error: str | None = None) -> None:
        """Mark the job answered (once): its rewards are complete, or `error` says why not."""
        if self.finished:
            return
        if error is not None:
            self.error = error
        self.finished = True
        self.on_done()


class BatchingWorker:
    """One thread that owns the model: it fills batches fairly from the waiting jobs and scores them."""

    def __init__(self, scorer: RewardScorer, batch_size: int, wait_s: float):
        self.scorer = scorer
        self.batch_size = batch_size
        self.wait_s = wait_s
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self.batches_run = 0
        self.active: list[Job] = []  # jobs with queries not yet scored, oldest first (worker thread only)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)

    def _admit(self, block_s: float) -> None:
        """Move queued jobs into the active list, waiting up to `block_s` for the first one."""
        try:
            self.active.append(self.jobs.get(timeout=block_s) if block_s > 0 else self.jobs.get_nowait())
            while True:
                self.active.append(self.jobs.get_nowait())
        except queue.Empty:
            pass

    def _fill(self) -> list[tuple[Job, int]]:
        """Round-robin over the active jobs: each contributes its next query in turn until the batch is full."""
        for job in self.active:
            if job.cancelled:
                job.finish()
        self.active = [j for j in self.active if not j.cancelled]
        taken = {id(j): 0 for j in self.active}
        picks: list[tuple[Job, int]] = []
        while len(picks) < self.batch_size:
            progressed = False
            for job in self.active:
                if taken[id(job)] < job.pending and len(picks) < self.batch_size:
                    picks.append((job, len(job.rewards) + taken[id(job)]))
                    taken[id(job)] += 1
                    progressed = True
            if not progressed:
                break
        return picks

    def _wait_for_company(self) -> None:
        """A short wait (--batch_wait_ms) lets concurrent requests share a forward pass that is not yet full."""
        if sum(j.pending for j in self.active) >= self.batch_size or self.wait_s <= 0:
            return
        deadline = time.monotonic() + self.wait_s
        while sum(j.pending for j in self.active) < self.batch_size and time.monotonic() < deadline:
            self._admit(deadline - time.monotonic())

    def _score(self, picks: list[tuple[Job, int]]) -> None:
        try:
            rewards = self.scorer.score([job.texts[i] for job, i in picks])
        except Exception as e:  # noqa: BLE001 - report to the requests in this batch, keep serving
            for job in {id(j): j for j, _ in picks}.values():
                job.cancelled = True
                job.finish(f"{type(e).__name__}: {e}")
        else:
            for (job, _), reward in zip(picks, rewards):  # picks of one job are in order
                job.rewards.append(reward)
        self.batches_run += 1

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._admit(0.1 if not self.active else 0)
            if not self.active:
                continue
            self._wait_for_company()
            picks = self._fill()
            if not picks:
                continue
            self._score(picks)
            for job in self.active:
                if job.pending == 0:
                    job.finish()
            self.active = [j for j in self.active if j.pending > 0 and not j.cancelled]
        for job in self.active:
            job.finish("server is shutting down")
        while not self.jobs.empty():  # fail whatever arrived during shutdown
            self.jobs.get_nowait().finish("server is shutting down")
