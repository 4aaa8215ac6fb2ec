# verl 0.7.1's verl/utils/__init__.py imports its config and tokenizer helpers (omegaconf, transformers); the
# copies need none of them (adapters/compat/verl/verl/__init__.py).
