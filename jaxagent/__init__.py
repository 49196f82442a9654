"""jaxagent: JAX-native RL for code-writing LLM agents."""

__version__ = "0.1.0"
