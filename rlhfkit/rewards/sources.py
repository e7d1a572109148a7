"""Reward sources without a reward model: a local Python reward function, or HTTP reward servers.

Both are selected with `--remote_rm_url` (OpenRLHF's flag) and score text:
- a file `path/to/reward.py` defining `reward_func(queries, prompts, labels)`; queries are prompt + response
  texts, prompts the formatted prompts, labels the `--label_key` values (None without one). It returns the
  rewards (a tensor, list or array with one number per query) or a dict {"rewards", "scores" (optional, in [0, 1]
  by convention, used for pass@1), "extra_logs" (optional, name -> number or per-sample values, logged as means)}.
  The file runs in worker processes (`--reward_workers`, `--reward_timeout`): a failing call is retried in halves
  (rlhfkit.rewards.halves) and a sample that fails alone gets `--reward_fallback`, counted in the metrics
  `reward/failures` and `reward/failure_kinds/<kind>`, until more than `--max_reward_failure_ratio` of a step's
  samples fail;
- comma-separated `http(s)://host:port/get_reward` URLs: each batch is split into contiguous chunks, one per server,
  posted in parallel threads as {"query": [...], "prompts": [...], "labels": [...]}; each server answers
  {"rewards": [...]} (optionally "scores" and "extra_logs"). Requests time out and are retried (server errors
  5xx, network errors and requests past --remote_rm_timeout, with exponential backoff, --remote_rm_retries attempts
  in all; a server still down or hung after them stops the run with ComponentFailed naming its URL; a 4xx answer
  is a UserError at once). With RLHFKIT_RM_API_KEY set, requests carry
  `Authorization: Bearer <key>` (`rlhfkit serve_rm --api_key`).

Every source has the method of the reward role: `score(batch) -> {"rewards": [B], "scores": [B], "extra_logs"}`
where batch holds "queries", "prompts" and "labels" lists (and token tensors a reward model would use), plus
"metrics" (failure counts) from a reward function file. A server's reward that is missing, of the wrong length, not
a number, NaN or infinite is a UserError naming the source.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.rl import BUILT_IN_REASONING_GYM
from rlhfkit.errors import ComponentFailed, UserError
from rlhfkit.rewards.halves import Attempt, Span, call_in_halves, failure_metrics
from rlhfkit.rewards.signature import takes_keyword, wrong_signature


class WrongLengthError(UserError):
    """A reward source returned a different number of values than it was given queries."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _as_vector(value: Any, n: int, what: str, where: str, finite: bool = True) -> torch.Tensor:
    """A float32 [n] tensor from a tensor / list / array / number sequence, checked for length and (unless
    `finite` is False) finiteness."""
    try:
        if isinstance(value, torch.Tensor):
            vector = value.detach().to("cpu", torch.float32).reshape(-1)
        else:
            vector = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{where}: {what} must be numbers, one per query, got {type(value).__name__} "
                        f"({_first_line(e)})") from None
    if vector.numel() != n:
        queries = "query" if n == 1 else "queries"
        raise WrongLengthError(f"{where}: returned {vector.numel()} {what} for {n} {queries}; return exactly one per "
                               "query")
    bad = (~torch.isfinite(vector)).nonzero()
    if finite and bad.numel():
        i = int(bad[0])
        raise UserError(f"{where}: {what} {vector[i].item()} for query {i} is not a finite number "
                        f"({bad.numel()} of {n} are NaN or infinite)")
    return vector


def _log_value(value: Any) -> float | None:
    """The mean of a logged value (number, tensor or list of numbers); None when it is not numeric."""
    try:
        t = torch.as_tensor(value.detach().cpu() if isinstance(value, torch.Tensor) else value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return float(t.mean()) if t.numel() else None


def parse_reward_output(output: Any, n: int, where: str, finite: bool = True) -> dict[str, Any]:
    """Turn what a reward function or server returned into {"rewards", "scores", "extra_logs"}; with
    `finite=False` NaN/inf entries are kept (for the caller to count as failed samples) instead of raising."""
    if isinstance(output, dict):
        if "rewards" not in output:
            raise UserError(f"{where}: the returned dict has no 'rewards' (keys: {', '.join(map(str, output))})")
        rewards = _as_vector(output["rewards"], n, "rewards", where, finite)
        scores = _as_vector(output["scores"], n, "scores", where, finite) if output.get("scores") is not None \
            else rewards.clone()
        extra = output.get("extra_logs") or {}
        if not isinstance(extra, dict):
            raise UserError(f"{where}: 'extra_logs' must be a dict of name -> number, got {type(extra).__name__}")
        logs = {str(k): v for k, v in ((k, _log_value(v)) for k, v in extra.items()) if v is not None}
        return {"rewards": rewards, "scores": scores, "extra_logs": logs}
    if output is None:
        raise UserError(f"{where}: returned None; return the rewards (one number per query) or a dict with "
                        "'rewards'")
    rewards = _as_vector(output, n, "rewards", where, finite)
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {}}


def _text_inputs(batch: dict[str, Any]) -> tuple[list[str], list[str], list[Any]]:
    queries = list(batch["queries"])
    prompts = list(batch.get("prompts") or [""] * len(queries))
    labels = batch.get("labels")
    labels = list(labels) if labels is not None else [None] * len(queries)
    return queries, prompts, labels


class RewardFunction:
    """`reward_func(queries, prompts, labels)` from a Python file (`--remote_rm_url path.py`), run in worker processes.

    A batch is scored in calls of at most `call_size` samples, spread over `workers` processes
    (rlhfkit.rewards.user_code). A call that raises, times out, kills its worker or returns something unusable is
    retried in halves until each part succeeds or is one sample, so only a sample that fails alone is lost; a NaN/inf
    reward costs its own sample at once. Failed samples get `fallback` as reward and score. When more than
    `max_failure_ratio` of a batch failed (any failure with 0, the strict mode), `score` raises a UserError naming the
    file, the first failure and one offending sample.
    """

    def __init__(self, path: str, workers: int = 1, timeout: float = 60.0, fallback: float = 0.0,
                 max_failure_ratio: float = 0.0, call_size: int | None = None):
        from rlhfkit.rewards.user_code import UserCodeLoadError, UserCodePool

        self.path = str(Path(path).expanduser())
        self.where = f"reward function {self.path}"
        if not Path(self.path).is_file():
            raise UserError(f"--remote_rm_url {path}: no such file")
        self.fallback = float(fallback)
        self.max_failure_ratio = float(max_failure_ratio)
        self.call_size = call_size
        self._warned = False
        try:
            self.pool = UserCodePool(self.path, workers=workers, timeout=timeout)
        except UserCodeLoadError as e:
            raise UserError(f"{self.where}: importing it failed ({e})") from None
        if "reward_func" not in self.pool.functions:
            self.pool.close()
            raise UserError(f"{self.where}: defines no function reward_func(queries, prompts, labels)")
        wrong = wrong_signature(self.path, "reward_func", 3)
        if wrong:
            self.pool.close()
            raise UserError(f"{self.where}: reward_func{wrong} has the wrong signature; it is called as "
                            "reward_func(queries, prompts, labels)")
        self.pass_images = takes_keyword(self.path, "reward_func", "images")  # image prompts' references

    def _run_round(self, spans: list[Span], queries: list[str], prompts: list[str], labels: list[Any],
                   images: list[list[str]] | None = None) -> list[Attempt]:
        """One round of calls, spread over the workers: each span's outcome, parsed (wrong type or length is a
        failure of the call; NaN/inf entries are kept, to cost only their own samples). `images`: each sample's
        image references, passed as `images=` to a reward_func that takes that keyword."""
        kwargs = [{"images": images[lo:hi]} for lo, hi in spans] if images is not None and self.pass_images else None
        results = self.pool.map("reward_func", [(queries[lo:hi], prompts[lo:hi], labels[lo:hi]) for lo, hi in spans],
                                kwargs)
        attempts = []
        for (lo, hi), result in zip(spans, results):
            if result.kind is not None:  # not result.ok
                attempts.append(Attempt(result.kind, result.error))
                continue
            try:
                attempts.append(Attempt(out=parse_reward_output(result.value, hi - lo, self.where, finite=False)))
            except UserError as e:
                kind = "wrong_length" if isinstance(e, WrongLengthError) else "bad_output"
                attempts.append(Attempt(kind, str(e).removeprefix(f"{self.where}: ")))
        return attempts

    def score(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Rewards of a batch in calls of `call_size` samples; a failed call is retried in halves
        (rlhfkit.rewards.halves), so only a sample that fails alone gets the fallback."""
        queries, prompts, labels = _text_inputs(batch)
        n = len(queries)
        size = max(1, self.call_size or n)
        rounds: list[float] = []  # seconds of each round of calls
        first_failed: list[tuple[Span, str]] = []  # the failed calls of the first round, with their error

        def run_round(spans: list[Span]) -> list[Attempt]:
            started = time.perf_counter()
            attempts = self._run_round(spans, queries, prompts, labels, batch.get("image_refs"))
            rounds.append(time.perf_counter() - started)
            if len(rounds) == 1:
                first_failed.extend((span, a.error) for span, a in zip(spans, attempts) if not a.ok)
            return attempts

        parts = call_in_halves([(lo, min(lo + size, n)) for lo in range(0, n, size)], run_round)
        self._warn_batch_only_failures(first_failed, parts)
        rewards, scores = torch.full((n,), self.fallback), torch.full((n,), self.fallback)
        failures: list[tuple[int, int, str, str]] = []  # (first sample, samples, kind, one-line reason)
        logs: list[tuple[dict[str, float], int]] = []
        for (lo, hi), attempt in parts:
            if attempt.out is None:
                failures.append((lo, hi - lo, attempt.kind or "bad_output", attempt.error))
                continue
            out = attempt.out
            good = torch.isfinite(out["rewards"]) & torch.isfinite(out["scores"])
            for i in (~good).nonzero().flatten().tolist():
                what = "rewards" if not torch.isfinite(out["rewards"][i]) else "scores"
                failures.append((lo + i, 1, "non_finite", f"{what} {out[what][i].item()} for query {lo + i} is not "
                                                          "a finite number"))
            rewards[lo:hi] = torch.where(good, out["rewards"], rewards[lo:hi])
            scores[lo:hi] = torch.where(good, out["scores"], scores[lo:hi])
            logs.append((out["extra_logs"], hi - lo))
        failed = sum(count for _, count, _, _ in failures)
        if failed and failed > self.max_failure_ratio * n:
            raise UserError(self._failure_message(failures, failed, n, queries))
        return {"rewards": rewards, "scores": scores, "extra_logs": _weighted_logs(logs),
                "metrics": failure_metrics(failures, rounds)}

    def _warn_batch_only_failures(self, first_failed: list[tuple[Span, str]],
                                  parts: list[tuple[Span, Attempt]]) -> None:
        """Warn once when a call failed but each of its samples then succeeded in a smaller call: the function
        fails on batches (e.g. it returns one value whatever it is given), and every step pays the retries."""
        if self._warned:
            return
        for (lo, hi), error in first_failed:
            if hi - lo > 1 and all(a.ok for (a_lo, _), a in parts if lo <= a_lo < hi):
                self._warned = True
                sys.stderr.write(f"warning: {self.where}: a call of {hi - lo} samples failed ({error}) but each of "
                                 "them succeeded in smaller calls; the calls are retried in halves every time "
                                 "(metrics reward/retry_rounds); make reward_func handle a batch of queries\n")
                return

    def _failure_message(self, failures: list[tuple[int, int, str, str]], failed: int, n: int,
                         queries: list[str]) -> str:
        first, _, _, reason = failures[0]
        sample = repr(queries[first][:160]) if queries else "''"
        limit = ("--max_reward_failure_ratio 0 allows none" if self.max_failure_ratio == 0 else
                 f"more than --max_reward_failure_ratio {self.max_failure_ratio:g}")
        return (f"{self.where}: {reason}; {failed} of {n} samples failed this step ({limit}); e.g. query {first}: "
                f"{sample}")

    def close(self) -> None:
        self.pool.close()


def _weighted_logs(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Per-call extra_logs merged into one mean per name, weighted by the call's samples."""
    logs: dict[str, float] = {}
    for key in {k for part, _ in parts for k in part}:
        values = [(part[key], w) for part, w in parts if key in part]
        logs[key] = sum(v * w for v, w in values) / max(sum(w for _, w in values), 1)
    return logs


#: Environment variable with the API key of reward servers started with one (`serve_rm --api_key`).
API_KEY_ENV = "RLHFKIT_RM_API_KEY"


def _post_json(url: str, payload: dict[str, Any], timeout: float) -> Any:
    data = json.dumps(payload, default=str).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    if os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode("utf-8"))


def _http_error(e: urllib.error.HTTPError) -> str:
    """`HTTP 401: <the server's {"error": ...} message>`."""
    try:
        detail = json.loads(e.read().decode("utf-8")).get("error", "")
    except Exception:  # noqa: BLE001 - the body is optional decoration
        detail = ""
    return f"HTTP {e.code}: {detail or e.reason}"


class _TooLarge(Exception):
    """A reward server answered 413: the request holds too many queries or bytes."""


def _merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate parsed reward outputs; extra logs are averaged weighted by sample count."""
    logs = _weighted_logs([(r["extra_logs"], len(r["rewards"])) for r in results])
    return {"rewards": torch.cat([r["rewards"] for r in results]),
            "scores": torch.cat([r["scores"] for r in results]), "extra_logs": logs}


class HTTPRewardClient:
    """Reward servers at one or more URLs; a batch is split over them and posted in parallel, each share in
    requests of at most `max_queries` queries (halved whenever a server answers 413, so a batch larger than a
    server's --max_queries_per_request or --max_body_bytes still gets scored)."""

    def __init__(self, urls: Sequence[str], timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 max_queries: int = 1024):
        if not urls:
            raise UserError("--remote_rm_url: no reward server URL given")
        self.max_queries = max_queries
        self.urls = list(urls)
        self.timeout = timeout
        self.retries = max(1, retries)
        self.backoff = backoff
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="reward-http")

    def _post_part(self, url: str, payload: dict[str, list]) -> dict[str, Any]:
        """Post one server's share in requests of at most `self.max_queries` queries (halved on a 413 until the
        server accepts them) and merge the answers."""
        n = len(payload["query"])
        outputs, start = [], 0
        while start < n:
            size = min(self.max_queries, n - start)
            part = {k: v[start:start + size] for k, v in payload.items()}
            try:
                outputs.append((self._request(url, part), size))
            except _TooLarge as e:
                if size == 1:
                    raise UserError(f"reward server {url} refused a single query as too large ({e}); raise the "
                                    "server's --max_body_bytes or shorten the responses") from None
                self.max_queries = max(1, size // 2)
                continue
            start += size
        results = [parse_reward_output(out, size, f"reward server {url}") for out, size in outputs]
        return _merge_results(results)

    def _request(self, url: str, payload: dict[str, Any]) -> Any:
        """Post one request: 5xx answers, network errors and requests past `self.timeout` are retried with
        exponential backoff, at most `self.retries` attempts; then ComponentFailed (the server is down or hung).
        A 4xx refusal is a UserError at once (retrying will not change the answer)."""
        last_text = "unknown error"
        started = time.monotonic()
        for attempt in range(self.retries):
            try:
                return _post_json(url, payload, self.timeout)
            except urllib.error.HTTPError as e:
                last_text = _http_error(e)
                if e.code == 413:
                    raise _TooLarge(last_text) from None
                if e.code < 500:  # the server understood and refused: retrying will not help
                    raise UserError(f"reward server {url}: no valid answer after {attempt + 1} attempt(s) "
                                    f"({last_text})") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last_text = _first_line(e)
                if "timed out" in last_text:
                    last_text += f" after --remote_rm_timeout {self.timeout:g} s"
            except ValueError as e:  # not JSON
                raise UserError(f"reward server {url}: the answer is not JSON ({_first_line(e)})") from None
            if attempt + 1 < self.retries:
                time.sleep(self.backoff * (2 ** attempt))
        raise ComponentFailed(f"reward server {url}: no valid answer after {self.retries} attempt(s) in "
                              f"{time.monotonic() - started:.1f} s (--remote_rm_retries; last: {last_text}); the run "
                              "stopped (restart the server, then rerun with --load_checkpoint to continue from the "
                              "last checkpoint)")

    def score(self, batch: dict[str, Any]) -> dict[str, Any]:
        queries, prompts, labels = _text_inputs(batch)
        n = len(queries)
        if n == 0:
            return {"rewards": torch.zeros(0), "scores": torch.zeros(0), "extra_logs": {}}
        parts = min(len(self.urls), n)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        jobs = []
        for i in range(parts):
            lo, hi = bounds[i], bounds[i + 1]
            payload = {"query": queries[lo:hi], "prompts": prompts[lo:hi], "labels": labels[lo:hi]}
            if batch.get("image_refs") is not None:  # image prompts: each sample's image references
                payload["images"] = batch["image_refs"][lo:hi]
            jobs.append(self._pool.submit(self._post_part, self.urls[i], payload))
        return _merge_results([job.result() for job in jobs])

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def reward_file(url: str) -> str:
    """The file a non-HTTP `--remote_rm_url` names: itself, or for `reasoning_gym` rewards/reasoning_gym_reward.py."""
    return str(Path(__file__).with_name("reasoning_gym_reward.py")) if url == BUILT_IN_REASONING_GYM else url


def make_remote_reward(urls: Sequence[str], timeout: float = 60.0,
                       retries: int = 3) -> RewardFunction | HTTPRewardClient:
    """The text reward source named by `--remote_rm_url`: a reward function file (with RewardFunction's defaults)
    or HTTP servers."""
    urls = [u for u in urls if u]
    if len(urls) == 1 and not urls[0].startswith(("http://", "https://")):
        return RewardFunction(reward_file(urls[0]))
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise UserError(f"--remote_rm_url: {bad[0]} is not an http(s) URL; a reward function file stands alone")
    return HTTPRewardClient(urls, timeout=timeout, retries=retries)
