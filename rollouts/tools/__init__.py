"""Agent tools over a persistent sandbox session (see `builtin.TOOLS`)."""

from rollouts.tools.builtin import TOOLS, ToolContext
from rollouts.tools.core import Param, Tool, Toolbox, ToolError, ToolOutput, truncate
from rollouts.tools.embedding import Embedding, NgramEmbedding
from rollouts.tools.memory import MemoryStore

__all__ = [
    "TOOLS",
    "Embedding",
    "MemoryStore",
    "NgramEmbedding",
    "Param",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "Toolbox",
    "truncate",
]
