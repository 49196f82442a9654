"""Code that runs *inside* the sandbox: stdlib only, flat sibling imports.

The directory is mounted read-only into the sandbox and started as a script
(`python -S zygote.py`), so its modules import each other as top-level names.
The host imports only `wire` (framing) and `codec` (tests) from here.
"""
