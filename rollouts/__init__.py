"""Rollouts: sampler, environments, sandboxed rewards and tasks."""
