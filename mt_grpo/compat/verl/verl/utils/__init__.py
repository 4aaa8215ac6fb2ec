# Copyright 2024 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License"); see adapters/compat/verl/LICENSE.
# verl 0.7.1's verl/utils/__init__.py imports its config and tokenizer helpers (omegaconf, transformers); the
# copies need none of them (adapters/compat/verl/verl/__init__.py).
