"""examples/agent_retry_addition.py: up to 3 attempts with feedback, and its episodes on the real engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from transformers import AutoTokenizer

from rlhfkit.agents.api import create_instance
from rlhfkit.agents.episodes import run_episodes
from rlhfkit.rollout.hf_engine import HFRolloutEngine

FILE = Path(__file__).resolve().parents[2] / "examples" / "agent_retry_addition.py"
spec = importlib.util.spec_from_file_location("agent_retry_addition", FILE)
retry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(retry)


def steps(actions: list[str], label: str = "83") -> list[dict]:
    async def run() -> list[dict]:
        agent = await create_instance(retry.AgentInstance)
        return [await agent.step({"action_text": a, "label": label, "sampling_params": None}) for a in actions]

    return asyncio.run(run())


def test_a_right_answer_ends_the_episode_with_reward_one():
    [out] = steps([" 83\nmore text"])
    assert out["done"] and out["rewards"] == 1.0 and out["environment_feedback"] == ""
    assert out["extra_logs"] == {"attempts": 1, "correct": 1.0, "first_attempt_correct": 1.0}


def test_wrong_answers_get_feedback_until_the_third_attempt():
    first, second, third = steps(["82", "830", "84"])
    assert not first["done"] and not second["done"] and third["done"]
    assert first["environment_feedback"] == second["environment_feedback"] == "\nUser: wrong, try again\nAssistant: "
    assert [o["rewards"] for o in (first, second, third)] == [0.0, 0.0, 0.0] and third["environment_feedback"] == ""
    late = steps(["1", "83"])[-1]
    assert late["done"] and late["rewards"] == 1.0 and late["extra_logs"]["first_attempt_correct"] == 0.0


def test_episodes_run_on_the_engine(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    engine = HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tokenizer)
    text = "User: What is 75+8?\nAssistant: "
    ids = [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
    feedback = len(tokenizer.encode(retry.FEEDBACK, add_special_tokens=False))
    episodes = run_episodes(engine.generate, tokenizer, str(FILE), [{"prompt": text, "prompt_ids": ids, "label": "83"}],
                            max_steps=3, max_length=60, seed=0, temperature=1.0, top_p=1.0, top_k=-1)
    for episode in episodes:
        assert 1 <= episode["turns"] <= 3 and episode["feedback_tokens"] == feedback * (episode["turns"] - 1)
        assert episode["reward"] in (0.0, 1.0) and len(episode["response_ids"]) <= 60
