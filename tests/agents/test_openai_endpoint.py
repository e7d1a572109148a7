"""The OpenAI-compatible endpoint over the policy: a plain HTTP client on 127.0.0.1 drives two-turn episodes, the
recorded traces are exactly the engine's tokens (feedback tokenised once, masked), and one RL step trains on them."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents import OpenAIAgentExecutor, Prompt
from rlhfkit.agents.episodes import BatchingGenerator, run_episodes
from rlhfkit.rollout.hf_engine import HFRolloutEngine
from tests.helpers import run_here

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_openai_http.py"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
FOLLOW_UP_TEXT = "<|user|>\nCheck it. Reply with the final answer only.\n<|assistant|>\n"  # the demo chat template


@pytest.fixture(scope="module")
def policy(demo_assets):
    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    engine = HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tok)
    calls: list[tuple[list[int], object]] = []

    def generate(prompt_ids, **kwargs):  # the real engine; the test keeps what it was asked and what it sampled
        out = engine.generate(prompt_ids, **kwargs)
        calls.extend(zip([list(p) for p in prompt_ids], out))
        return out

    return tok, generate, calls


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def refused(url: str, payload: dict) -> str:
    with pytest.raises(urllib.error.HTTPError) as info:
        post(url, payload)
    assert info.value.code == 400
    return json.load(info.value)["error"]["message"]


def test_two_turn_http_episodes_train_on_the_engine_tokens(policy):
    tok, generate, calls = policy
    calls.clear()
    questions = ["What is 2+3?", "What is 40+7?"]
    requests = [{"prompt": q, "prompt_ids": [tok.bos_token_id], "label": "5"} for q in questions]
    episodes = run_episodes(generate, tok, str(EXAMPLE), requests, max_steps=2, max_length=64, seed=0, **SAMPLING)
    eos = tok.eos_token_id
    follow_up = tok.encode(FOLLOW_UP_TEXT, add_special_tokens=False)
    not_identity = 0
    for question, episode in zip(questions, episodes):
        rendered = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
        prompt = tok.encode(rendered, add_special_tokens=False)
        assert episode["prompt_ids"] == prompt and episode["turns"] == 2 and episode["finish"] == "done"
        [(_, first)] = [(p, s) for p, s in calls if p == prompt]
        feedback = ([] if first.response_ids[-1] == eos else [eos]) + follow_up
        context = prompt + first.response_ids + feedback
        [(_, second)] = [(p, s) for p, s in calls if p == context]  # token in, token out: no re-tokenisation
        assert episode["response_ids"] == first.response_ids + feedback + second.response_ids
        assert episode["action_mask"] == [1] * len(first.response_ids) + [0] * len(feedback) + \
            [1] * len(second.response_ids)
        assert episode["logprobs"] == first.logprobs + [0.0] * len(feedback) + second.logprobs
        assert episode["feedback_tokens"] == len(feedback)
        trace = episode["prompt_ids"] + episode["response_ids"]
        not_identity += tok.encode(tok.decode(trace), add_special_tokens=False) != trace
    assert not_identity  # decode-then-encode changes the random model's tokens: a re-tokenising trace would differ
    assert len(calls) == 4


class Driver(OpenAIAgentExecutor):
    """Plain HTTP client code, with what the endpoint answered kept for the test."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode, self.replies, self.errors = mode, [], []

    def run_agent(self, base_url: str, prompt: str, label) -> float:
        if self.mode == "completions":
            first = post(f"{base_url}/completions", {"prompt": prompt, "max_tokens": 3})
            text = prompt + first["choices"][0]["text"] + "\nUser: again\nAssistant: "
            self.replies = [first, post(f"{base_url}/completions", {"prompt": text, "max_tokens": 3})]
            return 0.5
        messages = [{"role": "user", "content": prompt}]
        first = post(f"{base_url}/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 3})
        messages += [first["choices"][0]["message"], {"role": "user", "content": "again"}]
        rewritten = [messages[0], {"role": "assistant", "content": "42"}, messages[2]]
        self.errors = [refused(f"{base_url}/chat/completions", {"messages": rewritten}),  # the trace is unchanged
                       refused(f"{base_url}/chat/completions", {"messages": messages, "temperature": 0.3})]
        second = post(f"{base_url}/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 1.0})
        self.replies = [first, second]
        self.errors.append(refused(f"{base_url}/chat/completions", {"messages": messages + [
            second["choices"][0]["message"], {"role": "user", "content": "more"}]}))  # a third turn: budget is 2
        with urllib.request.urlopen(f"{base_url}/models", timeout=60) as response:
            self.errors.append(json.load(response)["data"][0]["id"])
        return 1.0


def drive(tok, generate, mode: str, budget: int = 40, prompt: str = "What is 2+3?"):
    llm = BatchingGenerator(generate, SAMPLING, seed=0)
    driver = Driver(mode).bind(max_steps=2, max_length=budget, llm_engine=llm, hf_tokenizer=tok, step_timeout=120)
    llm.active = 1
    episode = asyncio.run(driver.execute(Prompt(prompt, [tok.bos_token_id]), "5", dict(SAMPLING)))
    return driver, episode


def test_chat_replies_carry_the_recorded_tokens_and_bad_calls_are_refused(policy):
    tok, generate, calls = policy
    calls.clear()
    driver, episode = drive(tok, generate, "chat")
    first, second = driver.replies
    (p1, s1), (p2, s2) = calls
    assert first["prompt_token_ids"] == p1 == episode.prompt_ids and first["choices"][0]["token_ids"] == s1.response_ids
    assert second["prompt_token_ids"] == p2 and second["choices"][0]["token_ids"] == s2.response_ids
    assert [lp["logprob"] for lp in second["choices"][0]["logprobs"]["content"]] == s2.logprobs
    assert first["usage"]["completion_tokens"] == len(s1.response_ids) <= 3
    assert episode.prompt_ids + episode.response_ids == p2 + s2.response_ids and episode.turns == 2
    assert episode.reward == 1.0 and episode.finish == "done"
    assert "does not continue the episode's conversation" in driver.errors[0]
    assert "temperature=0.3 differs from the run's 1.0" in driver.errors[1]
    assert "turn budget (--max_steps 2) is spent" in driver.errors[2] and driver.errors[3] == "policy"


def test_completions_continue_the_text_token_exactly(policy):
    tok, generate, calls = policy
    calls.clear()
    driver, episode = drive(tok, generate, "completions")
    (p1, s1), (p2, s2) = calls
    suffix = tok.encode("\nUser: again\nAssistant: ", add_special_tokens=False)  # plain text: no eos added
    assert p1 == [tok.bos_token_id] + tok.encode("What is 2+3?", add_special_tokens=False)
    assert p2 == p1 + s1.response_ids + suffix
    assert episode.action_mask == [1] * len(s1.response_ids) + [0] * len(suffix) + [1] * len(s2.response_ids)
    assert episode.reward == 0.5 and driver.replies[1]["prompt_token_ids"] == p2
    calls.clear()
    drive(tok, generate, "completions", prompt=tok.bos_token + "What is 2+3?")  # a client that writes bos itself
    assert calls[0][0] == p1  # bos once


def test_one_rl_step_trains_on_http_driven_episodes(demo_assets, tmp_path, capsys):
    save = tmp_path / "out"
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(demo_assets.model_dir), "--prompt_data", str(demo_assets.rl_train),
        "--input_key", "prompt", "--label_key", "answer", "--agent_func_path", str(EXAMPLE), "--max_steps", "2",
        "--advantage_estimator", "reinforce", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
        "--micro_rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--max_samples", "4", "--generate_max_len", "64", "--prompt_max_len", "32", "--max_rl_steps", "1",
        "--actor_learning_rate", "1e-3", "--init_kl_coef", "0.01", "--zero_stage", "0", "--save_path", str(save),
        "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if "train/actor/policy_loss" in r]
    assert step["train/agent/turns"] == 2 and step["train/agent/feedback_tokens"] > 0
    assert step["train/agent/failures"] == 0 and step["train/response_length_max"] <= 64
    # the actor's log-probs of every action token (the second turn's too, past the feedback) are the engine's
    assert step["train/rollout_logprob_diff"] < 1e-4
    assert (save / "model.safetensors").is_file()


class LongPrompt(OpenAIAgentExecutor):
    """Sends a conversation past the model's context, then a short one."""

    def run_agent(self, base_url: str, prompt: str, label) -> float:
        self.error = refused(f"{base_url}/chat/completions", {"messages": [{"role": "user", "content": "7 " * 600}]})
        self.reply = post(f"{base_url}/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                           "max_tokens": 3})
        return 1.0


def test_a_conversation_past_the_model_s_context_is_refused_before_the_engine(policy):
    tok, generate, calls = policy
    calls.clear()
    assert tok.model_max_length == 512
    llm = BatchingGenerator(generate, SAMPLING, seed=0)
    agent = LongPrompt().bind(max_steps=2, max_length=40, llm_engine=llm, hf_tokenizer=tok, step_timeout=120)
    llm.active = 1
    episode = asyncio.run(agent.execute(Prompt("What is 2+3?", [tok.bos_token_id]), "5", dict(SAMPLING)))
    assert "at or over the model's context of 512" in agent.error
    assert len(calls) == 1 and agent.reply["prompt_token_ids"] == calls[0][0] == episode.prompt_ids
