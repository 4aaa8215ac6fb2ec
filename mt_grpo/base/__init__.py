"""The base floor: what every other floor shares, importing nothing of the package but mt_grpo.compat."""
