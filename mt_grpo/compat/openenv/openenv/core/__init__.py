# SPDX-License-Identifier: BSD-3-Clause
# Copied from openenv 0.10.0 (openenv-core 0.3.0), BSD-3-Clause: mt_grpo/compat/openenv/LICENSE.
