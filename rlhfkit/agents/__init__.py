"""Agents: multi-turn environments that train through the RL loop (`--agent_func_path agent.py`).

An agent file imports its bases from here (`from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase`, or
`MultiTurnAgentExecutor`); the agent files of OpenRLHF's example commands and of OpenRLHF 0.11 run unchanged, their
`from openrlhf.utils.agent import ...` line included (rlhfkit/agents/openrlhf_compat.py). A tool-calling agent
subclasses `ToolAgent` (rlhfkit.agents.tool_agent). An environment file defines a gym-style `Environment`
(rlhfkit.agents.environment: reset, step(action) -> observation, reward, done, info), run by `EnvironmentExecutor`.
"""

from rlhfkit.agents.api import AgentExecutorBase, AgentInstanceBase, Episode, MultiTurnAgentExecutor, Prompt
from rlhfkit.agents.env_agent import EnvironmentExecutor
from rlhfkit.agents.environment import Action, Environment, Step
from rlhfkit.agents.openai_endpoint import OpenAIAgentExecutor
from rlhfkit.agents.tool_agent import ToolAgent, ToolAgentExecutor
from rlhfkit.agents.tools import Tool, tool_from_function, tool_from_schema

__all__ = ["Action", "AgentExecutorBase", "AgentInstanceBase", "Environment", "EnvironmentExecutor", "Episode",
           "MultiTurnAgentExecutor", "OpenAIAgentExecutor", "Prompt", "Step", "Tool", "ToolAgent", "ToolAgentExecutor",
           "tool_from_function", "tool_from_schema"]
