"""OpenRLHF agent files as written (rlhfkit/agents/openrlhf_compat.py): the `openrlhf.utils.agent` import line, an
installed `openrlhf` left alone, and OpenRLHF 0.11's executors that call the engine themselves and return a dict."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents.api import AgentExecutorBase
from rlhfkit.agents.episodes import episodes_to_samples, load_agent_executor, run_episodes
from rlhfkit.agents.openrlhf_compat import IMPORT_ALIASES
from rlhfkit.errors import UserError
from rlhfkit.rewards.user_code import PinnedWorkers
from rlhfkit.rollout.hf_engine import HFRolloutEngine
from tests.cli.test_seed_commands import SEEDS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED = 99
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}

# OpenRLHF 0.11's style, written for this test: the whole `execute` overridden, the engine called in vLLM's form,
# OpenRLHF's dict returned. Two actions with feedback between them; the file asks for no log-probs.
AGENT_DICT = '''
from copy import deepcopy

from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, state_dict, **kwargs):
        return {"rewards": 0.5, "environment_feedback": " ok. ", "done": False}


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        tokens = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ranges, reward = [], 0.0
        for _ in range(2):
            sampling_params.max_tokens = 4
            sampling_params.logprobs = None
            out = await llm_engine.generate(tokens, deepcopy(sampling_params))
            action = list(out.outputs[0].token_ids)
            assert isinstance(out.outputs[0].text, str)
            ranges.append((len(tokens), len(tokens) + len(action)))
            tokens = tokens + action
            reward += 1.0 if "{label}" in out.outputs[0].text else 0.25
            tokens = tokens + hf_tokenizer(" ok. ", add_special_tokens=False)["input_ids"]
        return {"prompt": prompt, "label": label, "reward": reward, "scores": None, "observation_tokens": tokens,
                "action_ranges": ranges, "rollout_log_probs": None, "extra_logs": {"turns": len(ranges)}}
'''
BAD_DICT = AGENT_DICT.replace('"action_ranges": ranges', '"action_ranges": [(5, 2)]')


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


@pytest.fixture(scope="module")
def engine(demo_assets, tokenizer):
    return HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tokenizer)


def requests(tokenizer, n: int) -> list[dict]:
    texts = [f"User: What is {3 + i}+{4 + i}?\nAssistant: " for i in range(n)]
    return [{"prompt": t, "prompt_ids": [tokenizer.bos_token_id] + tokenizer.encode(t, add_special_tokens=False),
             "label": str(7 + 2 * i)} for i, t in enumerate(texts)]


@pytest.fixture
def stand_in_openrlhf(tmp_path, monkeypatch):
    """An installed `openrlhf` package whose every module records that it was imported."""
    marker = tmp_path / "imported.txt"
    root = tmp_path / "site" / "openrlhf"
    (root / "utils").mkdir(parents=True)
    note = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (root / "__init__.py").write_text(note)
    (root / "utils" / "__init__.py").write_text(note)
    (root / "utils" / "agent.py").write_text(note + "AgentExecutorBase = AgentInstanceBase = object\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "openrlhf" or m.startswith("openrlhf.")]:
        monkeypatch.delitem(sys.modules, name)
    yield marker
    for name in [m for m in sys.modules if m == "openrlhf" or m.startswith("openrlhf.")]:
        del sys.modules[name]


def test_the_examples_are_the_openrlhf_documents_agent_files_as_written():
    """examples/agent_func.py and agent_func_math.py are the agent blocks of OpenRLHF's documents (../shared/seeds),
    line for line: the import line included; only the indentation, which the documents' text lost, is restored."""
    if SEEDS is None:
        pytest.skip("OpenRLHF's example documents (../shared/seeds) are not on this machine")
    blocks = [b for p in sorted(SEEDS.glob("*.txt")) for b in re.findall(r"```python\n(.*?)```", p.read_text(), re.S)
              if "openrlhf.utils.agent" in b]
    seeds = [[line.strip() for line in b.splitlines() if line.strip()] for b in blocks]
    for name in ("agent_func.py", "agent_func_math.py"):
        lines = [line.strip() for line in (EXAMPLES / name).read_text().splitlines() if line.strip()]
        code = [line for line in lines if not line.startswith("#") or any(line in s for s in seeds)]
        assert code in seeds, name
        assert code[0 if code[0].startswith("from") else 1] == \
            "from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase"


def test_openrlhf_import_line_loads_rlhfkit_api_and_leaves_an_installed_openrlhf_alone(stand_in_openrlhf):
    cls = load_agent_executor(str(EXAMPLES / "agent_func.py"))
    assert issubclass(cls, AgentExecutorBase)
    assert not stand_in_openrlhf.exists()  # nothing of the installed package ran
    assert "openrlhf" not in sys.modules and "openrlhf.utils.agent" not in sys.modules
    import openrlhf.utils.agent  # the installed package is still the one `import openrlhf` finds

    assert openrlhf.utils.agent.AgentExecutorBase is object
    assert stand_in_openrlhf.read_text().split() == ["openrlhf", "openrlhf.utils", "openrlhf.utils.agent"]


def test_an_already_imported_openrlhf_is_restored_after_loading(stand_in_openrlhf):
    import openrlhf

    load_agent_executor(str(EXAMPLES / "agent_func_math.py"))
    assert sys.modules["openrlhf"] is openrlhf and "openrlhf.utils.agent" not in sys.modules


def test_other_openrlhf_modules_stop_with_one_line(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text("from openrlhf.utils.logging_utils import init_logger\n")
    with pytest.raises(UserError) as e:
        load_agent_executor(str(path))
    text = str(e.value)
    assert "\n" not in text and "openrlhf.utils.logging_utils" in text and "openrlhf.utils.agent" in text


def test_agent_workers_import_the_openrlhf_line_too(stand_in_openrlhf):
    pool = PinnedWorkers(str(EXAMPLES / "agent_func.py"), workers=1, timeout=30, import_aliases=IMPORT_ALIASES)
    try:
        assert {"AgentInstance", "AgentExecutor"} <= pool.functions
        assert pool.new("AgentInstance", "k").ok
        step = pool.call("k", "step", {"observation_text": "", "action_text": "x", "label": "1"})
        assert step.ok and step.value["done"] is False
    finally:
        pool.close()
    assert not stand_in_openrlhf.exists()


def test_a_dict_returning_executor_trains_on_exactly_the_sampled_tokens(engine, tokenizer, tmp_path):
    path = tmp_path / "agent_dict.py"
    path.write_text(AGENT_DICT)
    sampled: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def generate(prompt_ids, **kwargs):  # the engine's own generate, recording what it returned for each context
        out = engine.generate(prompt_ids, **kwargs)
        for ids, sample in zip(prompt_ids, out):
            sampled[tuple(ids)] = (list(sample.response_ids), list(sample.logprobs))
        return out

    reqs = requests(tokenizer, 3)
    eps = run_episodes(generate, tokenizer, str(path), reqs, max_steps=4, max_length=40, seed=SEED, **SAMPLING)
    feedback = tokenizer(" ok. ", add_special_tokens=False)["input_ids"]
    for request, e in zip(reqs, eps):
        prompt = tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
        assert e["prompt_ids"] == prompt and e["turns"] == 2 and e["finish"] == "done"
        context, response, at = list(prompt), e["response_ids"], 0
        for _ in range(2):  # action i is exactly what the engine sampled for the context before it
            action, logprobs = sampled[tuple(context)]
            assert response[at:at + len(action)] == action and e["logprobs"][at:at + len(action)] == logprobs
            assert e["action_mask"][at:at + len(action)] == [1] * len(action)
            at += len(action)
            assert response[at:at + len(feedback)] == feedback and e["action_mask"][at:at + len(feedback)] == \
                [0] * len(feedback) and e["logprobs"][at:at + len(feedback)] == [0.0] * len(feedback)
            context += action + feedback
            at += len(feedback)
        assert at == len(response)
        assert e["reward"] in (0.5, 1.25, 2.0) and e["score"] == e["reward"]
        assert e["extra_logs"] == {"turns": 2.0}
    samples, reward = episodes_to_samples(eps)
    assert [s.action_mask for s in samples] == [e["action_mask"] for e in eps]
    assert reward["rewards"].tolist() == [e["reward"] for e in eps]


def test_a_malformed_dict_costs_its_episode(engine, tokenizer, tmp_path):
    path = tmp_path / "agent_bad.py"
    path.write_text(BAD_DICT)
    eps = run_episodes(engine.generate, tokenizer, str(path), requests(tokenizer, 2), max_steps=4, max_length=40,
                       seed=SEED, **SAMPLING)
    assert [e["finish"] for e in eps] == ["failed", "failed"]
    assert eps[0]["error"].startswith("bad_output: execute returned action_ranges")
    _, reward = episodes_to_samples(eps, fallback=-1.0)
    assert reward["rewards"].tolist() == [-1.0, -1.0] and reward["metrics"]["agent/failure_kinds/bad_output"] == 2
