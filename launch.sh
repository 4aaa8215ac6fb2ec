#!/usr/bin/env bash
# Not implemented yet: vLLM on the last GPU + accelerate training on the others lands with the
# production-path issue. Until then, use the transformers backend (scripts/demo.sh).
echo "launch.sh is a stub: the vLLM-server launch path is not implemented yet (see README)." >&2
exit 1
