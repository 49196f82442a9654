"""textkit: small text and number utilities (the embedded repository of the agent tasks)."""
