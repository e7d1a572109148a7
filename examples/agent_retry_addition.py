"""OpenRLHF's math agent (examples/agent_func_math.py: up to 3 attempts, feedback after a wrong one) adapted to the
demo's addition task, whose answer is the first line of the response (`rlhfkit.demo.tasks.extract_answer`):

    python -m rlhfkit.cli.train_ppo ... --prompt_data <demo rl_train.jsonl> --input_key prompt --label_key answer \\
        --input_template "User: {}\\nAssistant: " --agent_func_path examples/agent_retry_addition.py --max_steps 3

A right answer ends the episode with reward 1.0 (success within the attempts); a wrong one is answered with
"wrong, try again" in the task's chat format; the third wrong answer ends the episode with 0.0.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase
from rlhfkit.demo.tasks import extract_answer

ATTEMPTS = 3
FEEDBACK = "\nUser: wrong, try again\nAssistant: "


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args: Any, **kwargs: Any):
        self.attempts = 0

    async def step(self, states: dict, **kwargs: Any) -> dict[str, Any]:
        self.attempts += 1
        correct = extract_answer(states["action_text"]) == str(states["label"]).strip()
        done = correct or self.attempts >= ATTEMPTS
        reward = 1.0 if correct else 0.0
        return {"rewards": reward, "scores": reward, "environment_feedback": "" if done else FEEDBACK,
                "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {"attempts": self.attempts, "correct": reward,
                               "first_attempt_correct": float(correct and self.attempts == 1)}}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
