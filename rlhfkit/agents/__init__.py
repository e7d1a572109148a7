"""Agents: multi-turn environments that train through the RL loop (`--agent_func_path agent.py`).

An agent file imports its bases from here (`from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase`, or
`MultiTurnAgentExecutor`): the seed's and OpenRLHF 0.11's agent files run after changing only that import line.
"""

from rlhfkit.agents.api import AgentExecutorBase, AgentInstanceBase, Episode, MultiTurnAgentExecutor, Prompt

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "Episode", "MultiTurnAgentExecutor", "Prompt"]
