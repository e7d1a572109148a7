"""The run report's agent trace viewer, end to end through the real saving code: tool-agent episodes
(examples/agent_tools.py, Hermes tool calls, scripted turns: good, malformed, unknown and failing calls, a truncated
episode, one whose grader raises) run by `run_episodes` inside a `RolloutSource` step, their traces saved to
samples.jsonl by the metrics logger as the trainer hands them over, and the report that logger writes rendered in
headless Chromium: no console error, no network request, every tool call shown equal to the saved trace, the masks'
token counts equal to the trained batch's, failures and truncation shown, and the reward filter working."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents.episodes import run_episodes
from rlhfkit.agents.tools import close_pools
from rlhfkit.config.base import parse_config
from rlhfkit.config.common import LoggingArgs
from rlhfkit.config.rl import PPOConfig
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.rl.rollout_source import RolloutSource
from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampledSequence
from rlhfkit.run.loop import LoopState
from tests.logging.test_html_report import render_in_chromium

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests" / "agents" / "tool_templates" / "hermes.jinja"
HOSTILE = '</script><img src="http://example.com/x.png">'  # must stay text: an <img> would request the network


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# question -> (label, the model's turns); the calls each episode makes, for the independent check below
SCRIPTS = {
    "What is 12*34?": ("408", [call("calculator", {"expression": "12*34"}), "The answer is 408."]),
    "What is 7+8?": ("15", ['<tool_call>{"name": calculator}</tool_call>',
                            call("search", {"q": "7+8"}) + "\n" + call("calculator", {}), "It is 14."]),
    "What is 1/0?": ("0", [call("calculator", {"expression": "1/0"}),
                           '<tool_call>{"name": "calculator", "arguments": {"expression": "' + "1+" * 700]),
    "What is 2**10?": ("raise", [call("calculator", {"expression": HOSTILE}),
                                call("calculator", {"expression": "2**10"}), "1024"]),
}
CALLS = {"What is 12*34?": [("calculator", True)],
         "What is 7+8?": [(None, False), ("search", False), ("calculator", False)],
         "What is 1/0?": [("calculator", False), (None, False)],
         "What is 2**10?": [("calculator", False), ("calculator", True)]}


# examples/agent_tools.py whose grader raises for the label "raise": that episode fails in its last turn
AGENT = """
import importlib.util
from rlhfkit.agents import ToolAgentExecutor
spec = importlib.util.spec_from_file_location("agent_tools_example", {path!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

class AgentInstance(example.AgentInstance):
    def final_reward(self, answer, label):
        if label == "raise":
            raise ValueError("the grader broke")
        return super().final_reward(answer, label)

class AgentExecutor(ToolAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


class ScriptedEngine:
    """A rollout engine whose agent episodes run through the real `run_episodes`, each turn the next scripted text
    of the episode's question (cut at the turn's token budget, as an engine would)."""

    def __init__(self, tok):
        self.tok, self.turn = tok, {q: 0 for q in SCRIPTS}

    def generate_turns(self, prompt_ids, *, max_new_tokens, seed=None, **sampling):
        out = []
        for ids in prompt_ids:
            question = next(q for q in SCRIPTS if q in self.tok.decode(ids))
            text = SCRIPTS[question][1][self.turn[question]]
            self.turn[question] += 1
            response = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            finish = FINISH_STOP if len(response) <= max_new_tokens else FINISH_LENGTH
            response = response[:max_new_tokens]
            out.append(SampledSequence(list(ids), response, [-0.5] * len(response), finish))
        return out

    def generate_episodes(self, requests, agent_path, **kwargs):
        return run_episodes(self.generate_turns, self.tok, agent_path, requests, **kwargs)

    def wake(self) -> None:
        pass

    def sleep(self) -> None:
        pass


@pytest.fixture(scope="module")
def tok(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    tokenizer.chat_template = TEMPLATE.read_text()
    yield tokenizer
    close_pools()


class _Traces(HTMLParser):
    """The rendered viewer: body flags, episodes (data-* and shown), their segments' token counts and tool calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.box: dict[str, str] = {}
        self.episodes: list[dict] = []
        self.imgs = 0
        self._text: str | None = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self.episodes[-1][self._text] += data

    def handle_endtag(self, tag: str) -> None:
        self._text = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "img":
            self.imgs += 1
        elif a.get("id") == "traces":
            self.box = a
        elif tag == "details" and "episode" in a.get("class", ""):
            self.episodes.append({**a, "act": 0, "fb": 0, "calls": [], "error": "", "failed_turns": 0})
        elif tag == "div" and a.get("class") == "bad" and self.episodes:
            self._text = "error"
        elif tag == "div" and a.get("class") == "turn-head bad" and self.episodes:
            self.episodes[-1]["failed_turns"] += 1
        elif tag == "pre" and "seg" in a.get("class", "") and self.episodes:
            kind = a["class"].split()[1]
            if kind in ("act", "fb"):
                self.episodes[-1][kind] += int(a["data-tokens"])
        elif tag == "tr" and "tool-call" in a.get("class", ""):
            self.episodes[-1]["calls"].append((a["data-name"], a["data-arguments"], a["data-result"], a["data-ok"]))


def render(page: Path, tmp_path: Path, fragment: str = "") -> _Traces:
    parsed = _Traces()
    parsed.feed(render_in_chromium(page, tmp_path, fragment=fragment).html)
    assert json.loads(parsed.body["data-errors"]) == [], parsed.body["data-errors"]
    assert parsed.body["data-resources"] == "0", "the page requested resources"
    assert parsed.imgs == 0  # the hostile argument stayed text
    return parsed


def shown_calls(call: dict) -> tuple[str, str, str, str]:
    """A saved tool call as the viewer writes it into the page."""
    args = call["arguments"]
    text = "" if args is None else args if isinstance(args, str) else json.dumps(args, separators=(",", ":"))
    return ("" if call["name"] is None else call["name"], text, call["result"], "1" if call["ok"] else "0")


def check_viewer(page: Path, saved: list[dict], tmp_path: Path) -> _Traces:
    """The report `page` renders every saved trace (samples.jsonl rows) with no console error and no request;
    each episode shows exactly its saved tool calls, in order, and its saved trained / feedback token counts."""
    parsed = render(page, tmp_path)
    assert parsed.body.get("data-rendered") == "1"
    assert parsed.box["data-rendered"] == str(len(saved)) and len(parsed.episodes) == len(saved)
    for row, shown in zip(saved, parsed.episodes):
        trace = row["trace"]
        assert shown["calls"] == [shown_calls(c) for turn in trace["turns"] for c in turn["tool_calls"]]
        assert (shown["act"], shown["fb"]) == (trace["trained_tokens"], trace["feedback_tokens"])
        assert int(shown["data-step"]) == row["step"]
        assert float(shown["data-reward"]) == pytest.approx(row["reward"])
    return parsed


def test_the_trace_viewer_shows_the_saved_episodes_in_chromium(tok, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(path=str(ROOT / "examples" / "agent_tools.py")))
    cfg = parse_config(PPOConfig, [
        "--pretrain", "tiny", "--prompt_data", "prompts", "--agent_func_path", str(agent),
        "--max_reward_failure_ratio", "0.5", "--reward_fallback", "-1",
        "--rollout_batch_size", "4", "--n_samples_per_prompt", "1", "--micro_rollout_batch_size", "4",
        "--train_batch_size", "4", "--micro_train_batch_size", "2", "--generate_max_len", "600", "--max_steps", "3",
        "--reward_timeout", "20", "--seed", "1"], "test")
    prompts = [{"prompt": q, "label": label} for q, (label, _) in SCRIPTS.items()]
    rollout = RolloutSource(cfg, ScriptedEngine(tok), None, tok, prompts).rollout(range(4), LoopState())
    logger = MetricsLogger(LoggingArgs(), str(tmp_path / "run"), "trace", {})
    logger.log(1, {"reward": float(rollout.reward["rewards"].mean())})
    logger.log_samples(1, rollout.report_rows(tok))  # as the trainer does
    logger.close()  # writes report.html
    saved = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(saved) == 4 and all("trace" in row for row in saved)

    parsed = check_viewer(tmp_path / "run" / "report.html", saved, tmp_path)
    finishes = {}
    lengths = rollout.experience.info["response_length"].tolist()
    for row, shown, mask, length in zip(saved, parsed.episodes, rollout.experience.action_mask, lengths):
        trace = row["trace"]
        # the saved calls (shown exactly, check_viewer) are the ones the scripted model made: an independent count
        assert [(c["name"], c["ok"]) for turn in trace["turns"] for c in turn["tool_calls"]] == CALLS[row["prompt"]]
        # the masks: green segments hold exactly the trained tokens of the batch, the rest is feedback
        assert shown["act"] == int(mask.sum()) and shown["act"] + shown["fb"] == length
        finishes[row["prompt"]] = (trace["finish"], shown["data-problem"])
    assert finishes == {"What is 12*34?": ("done", "0"), "What is 7+8?": ("done", "0"),
                        "What is 1/0?": ("budget", "1"), "What is 2**10?": ("failed", "1")}
    failed = parsed.episodes[3]  # its error, and the turn whose step raised, are shown
    assert saved[3]["reward"] == -1.0 and "the grader broke" in saved[3]["trace"]["error"]
    assert failed["error"] == "failed: " + saved[3]["trace"]["error"] and failed["failed_turns"] == 1
    hostile = json.dumps({"expression": HOSTILE}, separators=(",", ":"))
    assert [c[1] for c in parsed.episodes[3]["calls"]][0] == hostile  # shown as text, requested nothing

    # the reward filter, preset from the address; and the request check works: the same page with one image from
    # the network counts it (one browser run for both)
    leaky = tmp_path / "run" / "leaky.html"
    leaky.write_text((tmp_path / "run" / "report.html").read_text().replace(
        "</body>", '<img src="http://example.com/x.png"></body>'))
    filtered = _Traces()
    filtered.feed(render_in_chromium(leaky, tmp_path, fragment="#trace-min=0.5").html)
    assert filtered.body["data-resources"] == "1" and json.loads(filtered.body["data-errors"]) == []
    kept = [row["prompt"] for row, e in zip(saved, filtered.episodes) if e["data-shown"] == "1"]
    assert kept == [row["prompt"] for row in saved if row["reward"] >= 0.5] == ["What is 12*34?"]
