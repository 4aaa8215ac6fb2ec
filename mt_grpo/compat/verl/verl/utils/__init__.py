# Copyright 2024 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License"); see mt_grpo/compat/verl/LICENSE.
# verl 0.7.1's verl/utils/__init__.py imports its config and tokenizer helpers (omegaconf, transformers); the
# copies need none of them (mt_grpo/compat/verl/verl/__init__.py).
