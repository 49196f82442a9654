"""Multi-turn tool-using episodes over repository tasks (see `env.ToolEnvironment`)."""

from rollouts.agent.config import AgentConfig
from rollouts.agent.env import ToolEnvironment, edited_test_files
from rollouts.agent.formats import BadCall, ToolCall, make_format, observation_text

__all__ = [
    "AgentConfig",
    "BadCall",
    "ToolCall",
    "ToolEnvironment",
    "edited_test_files",
    "make_format",
    "observation_text",
]
