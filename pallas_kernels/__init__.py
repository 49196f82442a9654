"""Pallas kernels: one kernel per module, each with a plain-JAX ``*_reference`` beside it."""
