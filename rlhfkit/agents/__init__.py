"""Agents: multi-turn environments that train through the RL loop (`--agent_func_path agent.py`).

An agent file imports its bases from here (`from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase`, or
`MultiTurnAgentExecutor`); the agent files of OpenRLHF's example commands and of OpenRLHF 0.11 run unchanged, their
`from openrlhf.utils.agent import ...` line included (rlhfkit/agents/openrlhf_compat.py).
"""

from rlhfkit.agents.api import AgentExecutorBase, AgentInstanceBase, Episode, MultiTurnAgentExecutor, Prompt
from rlhfkit.agents.openai_endpoint import OpenAIAgentExecutor

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "Episode", "MultiTurnAgentExecutor", "OpenAIAgentExecutor",
           "Prompt"]
