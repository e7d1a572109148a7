"""A test agent for vision-language policies: after each short turn it shows a freshly drawn image with its
feedback (`environment_images`, OpenRLHF's multi-turn VLM form), until the episode's second turn, which scores 1 when
its first token is odd (a reward that varies within a group on an untrained model)."""

import random

from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase
from rlhfkit.demo.vlm_tasks import make_image_problem

TURN_TOKENS = 3


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn >= 2:
            return {"rewards": float(states["action_ids"][0] % 2), "done": True}
        image = make_image_problem("dots", random.Random(len(states["action_ids"])))["image"]
        return {"rewards": 0.0, "environment_feedback": " Look: <image> Count again.", "environment_images": [image],
                "done": False}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params, *args, **kwargs):
        return await super().execute(prompt, label, {**sampling_params, "max_tokens": TURN_TOKENS}, *args, **kwargs)
