"""A test agent whose turns are short (4 tokens: the demo model never emits eos) and never done, so an episode has
several turns with feedback between them; used by the partial-rollout tests (tests/rl/partial_agent.py)."""

from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase

TURN_TOKENS = 4


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": " ok ", "done": False}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params, *args, **kwargs):
        return await super().execute(prompt, label, {**sampling_params, "max_tokens": TURN_TOKENS}, *args, **kwargs)
