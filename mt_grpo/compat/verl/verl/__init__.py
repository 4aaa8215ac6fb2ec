# Copyright 2024 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License"); see mt_grpo/compat/verl/LICENSE.
"""Copies of the parts of verl 0.7.1 (PyPI wheel verl-0.7.1-py3-none-any.whl, Apache-2.0) that environments written
for verl import, shipped with mt-grpo so that such an environment runs without installing verl (whose
`verl/__init__.py` imports torch distributed, ray, tensordict and omegaconf). mt_grpo/compat/__init__.py puts this
folder's parent first on sys.path only when the real verl does not import; an installed verl always wins.

    verl.tools.base_tool, schemas, gsm8k_tool       BaseTool, OpenAIFunctionToolSchema, ToolResponse, Gsm8kTool
    verl.interactions.base, gsm8k_interaction       BaseInteraction, Gsm8kInteraction
    verl.utils.reward_score                         default_compute_score and its single-file scorers (gsm8k,
                                                    math_reward, math_dapo, geo3k, search_r1_like_qa_em, ...)

Each file is the wheel's, byte for byte, but for three: this one (the wheel's imports the training stack),
utils/__init__.py (empty: the wheel's imports the config and tokenizer helpers), and utils/rollout_trace.py (only the
decorator, a no-op without a tracing backend; the wheel's imports ray). Not copied: reward_score's prime_math,
prime_code and sandbox_fusion (they need verl.utils.py_functional and sympy/pylatexenc or a sandbox), so their data
sources fail to import here: install verl for them."""

__version__ = "0.7.1"
