# SPDX-License-Identifier: BSD-3-Clause
# Copied from openenv 0.10.0 (openenv-core 0.3.0), BSD-3-Clause: mt_grpo/compat/openenv/LICENSE.
"""Copies of OpenEnv's core types (`openenv` 0.10.0 / `openenv-core` 0.3.0: openenv/core/env_server/
types.py and interfaces.py), shipped with mt-grpo so that an environment written for OpenEnv runs without
installing it (the real package does not import without fastapi and fastmcp). Same names, fields, defaults
and signatures; the servers, clients and MCP types are left out. mt_grpo/compat/__init__.py puts this
folder's parent first on sys.path only when the real openenv does not import; an installed one wins."""
