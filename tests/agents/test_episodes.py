"""Agent episodes on the real Transformers engine with the tiny demo model: token in, token out, the budgets, both
API generations, batching of concurrent episodes, and feedback tokens out of every loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfkit.agents.episodes import episodes_to_samples, run_episodes
from rlhfkit.algorithms.kl import compute_approx_kl
from rlhfkit.algorithms.policy_loss import policy_loss
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rollout.hf_engine import HFRolloutEngine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FEEDBACK = "\nUser: not yet, try 12+30 again\nAssistant: "
# OpenRLHF 0.11's form: MultiTurnAgentExecutor with an argument-less __init__; a plain (not async) __init__;
# done after `label` turns; each turn capped at 3 tokens through the sampling params.
AGENT_011 = f"""
from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= int(states["label"])
        return {{"rewards": 0.25, "scores": float(done), "environment_feedback": {FEEDBACK!r}, "done": done,
                "sampling_params": states["sampling_params"], "extra_logs": {{"turn": self.turn}}}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params):
        return await super().execute(prompt, label, {{**sampling_params, "max_tokens": 3}})
"""
SEED = 1234


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


@pytest.fixture(scope="module")
def engine(demo_assets, tokenizer):
    return HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tokenizer)


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agent") / "agent_011.py"
    path.write_text(AGENT_011)
    return str(path)


def requests(tokenizer, label: str, n: int = 1) -> list[dict]:
    texts = [f"User: What is {10 + i}+{20 + i}?\nAssistant: " for i in range(n)]
    return [{"prompt": t, "prompt_ids": [tokenizer.bos_token_id] + tokenizer.encode(t, add_special_tokens=False),
             "label": label} for t in texts]


def test_two_turns_continue_from_the_exact_token_ids(engine, tokenizer, agent_file):
    [request] = requests(tokenizer, "2")
    [ep] = run_episodes(engine.generate, tokenizer, agent_file, [request], max_steps=5, max_length=40, seed=SEED,
                        temperature=1.0, top_p=1.0, top_k=-1)
    assert (ep["finish"], ep["turns"], ep["truncated"]) == ("done", 2, False)
    assert ep["prompt_ids"] == request["prompt_ids"]
    feedback = tokenizer.encode(FEEDBACK, add_special_tokens=False)
    # turn 1 and turn 2, each exactly what the engine samples from the exact context (seeds: one call per turn)
    first = engine.generate([request["prompt_ids"]], max_new_tokens=3, seed=SEED)[0]
    second = engine.generate([request["prompt_ids"] + first.response_ids + feedback], max_new_tokens=3,
                             seed=SEED + 1000)[0]
    assert ep["response_ids"] == first.response_ids + feedback + second.response_ids
    assert ep["action_mask"] == [1] * len(first.response_ids) + [0] * len(feedback) + [1] * len(second.response_ids)
    assert ep["logprobs"] == pytest.approx(first.logprobs + [0.0] * len(feedback) + second.logprobs)
    assert ep["feedback_tokens"] == len(feedback)
    assert ep["reward"] == 0.5 and ep["score"] == 1.0 and ep["extra_logs"] == {"turn": 2.0}  # turn rewards add up


def test_trained_tokens_are_the_sampled_tokens_not_a_retokenisation(engine, tokenizer, agent_file, demo_assets):
    eps = run_episodes(engine.generate, tokenizer, agent_file, requests(tokenizer, "3", n=4), max_steps=5,
                       max_length=100, seed=SEED, temperature=1.0, top_p=1.0, top_k=-1)
    samples, reward = episodes_to_samples(eps)
    # The demo tokenizer is a BPE: decoding the sampled ids and encoding the text again gives other ids.
    assert any(tokenizer.encode(tokenizer.decode(e["response_ids"]), add_special_tokens=False) != e["response_ids"]
               for e in eps)
    exp = experience_from_samples(samples, tokenizer.pad_token_id)
    for i, e in enumerate(eps):
        assert exp.sequences[i, :len(e["prompt_ids"]) + len(e["response_ids"])].tolist() == \
            e["prompt_ids"] + e["response_ids"]
    # the rollout log-probs are the model's own log-probs of exactly those tokens (teacher forcing)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(**exp.model_inputs()).logits.float(), dim=-1)
    positions = exp.action_positions()
    tokens = exp.action_tokens()
    recomputed = logp[torch.arange(len(exp))[:, None], positions, tokens]
    mask = exp.action_mask
    assert torch.allclose(recomputed[mask], exp.rollout_log_probs[mask], atol=1e-4)
    assert reward["rewards"].tolist() == [0.75] * 4 and reward["metrics"]["agent/turns"] == 3.0
    assert reward["metrics"]["agent/generate_batch_max"] == 4.0  # the 4 concurrent episodes shared engine calls


def test_feedback_tokens_get_zero_gradient_and_zero_kl(engine, tokenizer, agent_file):
    eps = run_episodes(engine.generate, tokenizer, agent_file, requests(tokenizer, "2", n=2), max_steps=5,
                       max_length=40, seed=SEED, temperature=1.0, top_p=1.0, top_k=-1)
    exp = experience_from_samples(episodes_to_samples(eps)[0], tokenizer.pad_token_id)
    mask = exp.action_mask
    feedback = torch.zeros_like(mask)
    for i, e in enumerate(eps):
        feedback[i, :len(e["action_mask"])] = torch.tensor([m == 0 for m in e["action_mask"]])
    assert feedback.sum() == sum(e["feedback_tokens"] for e in eps) > 0 and not (feedback & mask).any()
    torch.manual_seed(0)
    # a small change of policy: inside the clip range, so every action token has a gradient
    logp = (exp.rollout_log_probs + 0.01 * torch.randn(mask.shape)).requires_grad_(True)
    loss, _ = policy_loss(logp, exp.rollout_log_probs, torch.randn(mask.shape), mask)
    loss.backward()
    assert torch.all(logp.grad[feedback] == 0) and torch.all(logp.grad[mask] != 0)
    ref = exp.rollout_log_probs + torch.randn(mask.shape)
    for estimator in ("k1", "k2", "k3"):
        kl = compute_approx_kl(logp.detach(), ref, estimator, mask)
        assert torch.all(kl[feedback] == 0) and torch.all(kl[mask] != 0)


def test_episodes_stop_at_the_token_budget_and_the_turn_budget(engine, tokenizer, agent_file):
    sampling = dict(seed=SEED, temperature=1.0, top_p=1.0, top_k=-1)
    [budget] = run_episodes(engine.generate, tokenizer, agent_file, requests(tokenizer, "100"), max_steps=None,
                            max_length=12, **sampling)
    assert budget["finish"] == "budget" and budget["truncated"] and len(budget["response_ids"]) <= 12
    [turns] = run_episodes(engine.generate, tokenizer, agent_file, requests(tokenizer, "100"), max_steps=3,
                           max_length=200, **sampling)
    assert (turns["finish"], turns["turns"], turns["truncated"]) == ("turns", 3, False)
    assert turns["action_mask"][-1] == 1  # no feedback after the last turn


def test_the_seed_template_runs_with_only_its_import_changed(engine, tokenizer):
    """OpenRLHF's form: AgentExecutor(max_steps, max_length, llm_engine, hf_tokenizer, result_queue) calling
    super().__init__(AgentInstance, ...), an `async def __init__`, an `execute` override."""
    eps = run_episodes(engine.generate, tokenizer, str(EXAMPLES / "agent_func.py"), requests(tokenizer, "7", n=2),
                       max_steps=2, max_length=60, seed=SEED, temperature=1.0, top_p=1.0, top_k=-1,)
    for e in eps:
        assert e["turns"] <= 2 and e["reward"] == 0.0 and e["finish"] in ("turns", "budget")
        assert e["extra_logs"] == {"step": float(e["turns"])}


BAD_AGENT = """
import asyncio
from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        if states["label"] == "raise":
            raise ValueError("bad environment")
        if states["label"] == "hang":
            await asyncio.sleep(60)
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_bad_and_timeout_agent_steps_cost_their_episode_only(engine, tokenizer, tmp_path):
    path = tmp_path / "bad_agent.py"
    path.write_text(BAD_AGENT)
    reqs = requests(tokenizer, "ok", n=4)
    reqs[1]["label"], reqs[2]["label"] = "raise", "hang"
    eps = run_episodes(engine.generate, tokenizer, str(path), reqs, max_steps=2, max_length=6, seed=SEED,
                       step_timeout=1.0, temperature=1.0, top_p=1.0, top_k=-1)
    assert [e["finish"] for e in eps] == ["done", "failed", "failed", "done"]
    assert eps[1]["error"] == "exception: step raised ValueError: bad environment"
    assert eps[2]["error"] == "timeout: step took more than 1 s"
    assert all(len(e["response_ids"]) > 0 for e in eps)  # a failed episode keeps the tokens it sampled
    samples, reward = episodes_to_samples(eps, fallback=-1.0, max_failure_ratio=0.5, where="agent X")
    assert reward["rewards"].tolist() == [1.0, -1.0, -1.0, 1.0] and len(samples) == 4
    assert reward["metrics"]["agent/failures"] == 2.0
    assert reward["metrics"]["agent/failure_kinds/exception"] == 1.0
    assert reward["metrics"]["agent/failure_kinds/timeout"] == 1.0
    from rlhfkit.errors import UserError

    with pytest.raises(UserError, match=r"^agent X: exception: step raised ValueError: bad environment; 2 of 4 "
                                        r"episodes failed this step \(more than --max_reward_failure_ratio 0.25\); "
                                        r"e.g. episode 1: 'User: What is 11\+21\?\\nAssistant: '$"):
        episodes_to_samples(eps, max_failure_ratio=0.25, where="agent X", prompts=[r["prompt"] for r in reqs])


CRASHING_AGENT = """
import ctypes, os, time
from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        if states["label"] == "exit":
            os._exit(3)
        if states["label"] == "segfault":
            ctypes.string_at(0)
        if states["label"] == "block":
            time.sleep(60)  # blocking: only a worker process can be stopped
        return {"rewards": 0.5, "environment_feedback": " again: ", "done": self.turn >= 2,
                "extra_logs": {"pid": os.getpid()}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params):
        return await super().execute(prompt, label, {**sampling_params, "max_tokens": 3})
"""


def test_crash_and_timeout_of_isolated_agent_instances_cost_their_episode(engine, tokenizer, tmp_path):
    import os

    path = tmp_path / "crashing_agent.py"
    path.write_text(CRASHING_AGENT)
    reqs = requests(tokenizer, "ok", n=4)
    reqs[1]["label"], reqs[2]["label"], reqs[3]["label"] = "exit", "segfault", "block"
    eps = run_episodes(engine.generate, tokenizer, str(path), reqs, max_steps=3, max_length=30, seed=SEED,
                       step_timeout=2.0, agent_workers=4, temperature=1.0, top_p=1.0, top_k=-1)
    assert [e["finish"] for e in eps] == ["done", "failed", "failed", "failed"]
    assert eps[0]["reward"] == 1.0 and eps[0]["turns"] == 2 and eps[0]["extra_logs"]["pid"] != os.getpid()
    assert eps[1]["error"] == "crash: step: the worker exited (exit code 3)"
    assert eps[2]["error"] == "crash: step: the worker died (signal SIGSEGV)"
    assert eps[3]["error"] == "timeout: step took more than 2 s (killed)"
    # the workers were replaced: the same file runs again at once in this process
    again = run_episodes(engine.generate, tokenizer, str(path), requests(tokenizer, "ok", n=2), max_steps=3,
                         max_length=30, seed=SEED, step_timeout=2.0, agent_workers=4, temperature=1.0, top_p=1.0,
                         top_k=-1)
    assert [e["finish"] for e in again] == ["done", "done"]
    assert set(again[0]["batch_sizes"]) == {2}  # each turn of both episodes in one engine call, workers or not


def test_a_reset_text_that_starts_with_bos_gets_no_second_bos(tokenizer):
    # A text-mode agent whose reset renders the prompt through a chat template: Llama 3's template writes
    # <|begin_of_text|>, SmolLM2's starts with <|im_start|>, the tokenizers' bos; the executor adds bos itself.
    from rlhfkit.agents.api import AgentExecutorBase

    executor = AgentExecutorBase(hf_tokenizer=tokenizer)
    body = tokenizer.encode("User: hi\nAssistant: ", add_special_tokens=False)
    bos = tokenizer.bos_token_id
    assert executor._prompt_ids(tokenizer.bos_token + "User: hi\nAssistant: ", "other") == [bos, *body]
    assert executor._prompt_ids("User: hi\nAssistant: ", "other") == [bos, *body]
