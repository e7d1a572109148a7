# ruff: noqa -- OpenRLHF's code kept as users paste it (its unused variables and placeholder included)
# OpenRLHF's agent template (the skill document's "Agent API" section), unchanged but for the indentation that
# the document's text lost; its `openrlhf.utils.agent` import line runs as it is (rlhfkit/agents/openrlhf_compat.py).
# Train with: --agent_func_path examples/agent_func.py --max_steps 3
# (its `calculate_reward` is the template's placeholder: the instance's own 5-step horizon is never reached within
# 3 turns, so every episode ends by the turn budget with reward 0).
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase
import torch
from typing import Dict, Any
class AgentInstance(AgentInstanceBase):
    """Manages state for a single agent episode."""
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 5 # Maximum environment steps
    async def reset(self, states: dict, **kwargs):
        """Reset environment for new episode."""
        return {"observation": states["observation"]}
    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        """Execute one environment step."""
        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]
        # Your environment logic here
        done = self.step_idx >= self.max_steps
        reward = calculate_reward(action_text, label) if done else 0.0
        # Environment feedback for next step
        if done:
            environment_feedback = "\n\n[EPISODE COMPLETE]\n</s>"
        else:
            environment_feedback = "\n\nNext step:\n</s>\n\nAssistant: "
        self.step_idx += 1
        return {
            "rewards": torch.tensor([reward]),
            "scores": torch.tensor([reward]),
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"step": self.step_idx}
        }
class AgentExecutor(AgentExecutorBase):
    """Orchestrates agent execution."""
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
    async def execute(self, prompt, label, sampling_params):
        # Override for custom execution logic
        return await super().execute(prompt, label, sampling_params)
