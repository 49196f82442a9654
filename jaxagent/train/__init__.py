"""Training, by job: build.py (a run's parts from its config), sft.py (supervised warm-up and
`jaxagent sft`), loop.py (the RL loop, `jaxagent train`), evaluate.py (pass@k, `jaxagent eval`).
"""
