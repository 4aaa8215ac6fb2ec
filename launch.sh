#!/usr/bin/env bash
# MT-GRPO on one node: vLLM serves generation on the last GPU(s), accelerate trains on the others.
# Several nodes under SLURM: scripts/slurm_launch.sh.
#
#   ./launch.sh [--dry-run] RECIPE.yaml [trainer flags...]
#   NUM_GPUS=8 ./launch.sh --dry-run hf_recipes/Qwen/Qwen2.5-7B-Instruct/mt_grpo.yaml
#
# It runs from any folder: a relative RECIPE is read from the current one, and the trainer runs from the repository
# (this script's folder). The recipe is read with PYTHON's PyYAML, as the trainer reads it (scripts/recipe_values.py).
#
# Settings (environment variables, with defaults):
#   NUM_GPUS=8                 GPUs on this node
#   VLLM_TP=1 VLLM_DP=1        vLLM tensor / data parallel size of a server, on VLLM_TP*VLLM_DP GPUs
#   VLLM_SERVERS=1             vLLM servers on this node, on the last VLLM_SERVERS*VLLM_TP*VLLM_DP GPUs; with
#                              more than one the trainer gets them all in --vllm_server_urls
#                              (mt_grpo/engine/server_pool.py: each group goes to one server, the weights reach all)
#   VLLM_PORT=8000             vLLM HTTP port (passed to the trainer as --vllm_server_port); server i: VLLM_PORT+i
#   VLLM_GPU_MEMORY=0.9        vLLM --gpu-memory-utilization
#   VLLM_MAX_MODEL_LEN=4096    vLLM --max-model-len (prompt + whole multi-turn completion)
#   VLLM_HEALTH_TIMEOUT=900    seconds to wait for the server before giving up
#   ACCELERATE_CONFIG=accelerate_configs/zero3.yaml   (zero2.yaml, zero3_multinode.yaml; relative to the repository)
#   PYTHON=python              interpreter with vllm, trl and accelerate installed (and so PyYAML)
#   JUDGE_MODEL=               an LLM judge (mt_grpo/rewards/judge.py) served by its own vLLM on JUDGE_GPUS GPUs,
#                              taken just before the generation server's; the trainer gets
#                              --judge_base_url/--judge_model
#   JUDGE_GPUS=1 JUDGE_PORT=8001 JUDGE_GPU_MEMORY=0.9 JUDGE_MAX_MODEL_LEN=8192
# A LoRA recipe (use_peft: true) also gets the server's LoRA flags (--enable-lora, --max-lora-rank, ...).
# The server is stopped when training ends, fails, or is interrupted (Ctrl-C).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
source "$ROOT/scripts/launch_common.sh"  # check_recipe, recipe_path, read_recipe, *_flags, show

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
RECIPE=${1:?usage: ./launch.sh [--dry-run] RECIPE.yaml [trainer flags...]}
shift
check_recipe launch.sh
RECIPE=$(recipe_path)
cd "$ROOT"  # the trainer runs from the repository: the recipes' output_dir and the accelerate configs are relative

NUM_GPUS=${NUM_GPUS:-8}
VLLM_TP=${VLLM_TP:-1}
VLLM_DP=${VLLM_DP:-1}
VLLM_SERVERS=${VLLM_SERVERS:-1}
VLLM_PORT=${VLLM_PORT:-8000}
VLLM_GPU_MEMORY=${VLLM_GPU_MEMORY:-0.9}
VLLM_MAX_MODEL_LEN=${VLLM_MAX_MODEL_LEN:-4096}
VLLM_HEALTH_TIMEOUT=${VLLM_HEALTH_TIMEOUT:-900}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/zero3.yaml}
PYTHON=${PYTHON:-python}
JUDGE_MODEL=${JUDGE_MODEL:-}
JUDGE_GPUS=${JUDGE_GPUS:-1}
JUDGE_PORT=${JUDGE_PORT:-8001}
JUDGE_GPU_MEMORY=${JUDGE_GPU_MEMORY:-0.9}
JUDGE_MAX_MODEL_LEN=${JUDGE_MAX_MODEL_LEN:-8192}

if ! [[ "$VLLM_SERVERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch.sh: VLLM_SERVERS=$VLLM_SERVERS: give a number of servers, 1 or more" >&2
  exit 2
fi
SERVER_GPUS=$((VLLM_TP * VLLM_DP))
VLLM_GPUS=$((SERVER_GPUS * VLLM_SERVERS))
if [ -z "$JUDGE_MODEL" ]; then JUDGE_GPUS=0; fi
TRAIN_GPUS=$((NUM_GPUS - VLLM_GPUS - JUDGE_GPUS))
if [ "$TRAIN_GPUS" -lt 1 ]; then
  echo "launch.sh: NUM_GPUS=$NUM_GPUS leaves no GPU for training after $VLLM_GPUS for vLLM (VLLM_SERVERS x VLLM_TP" \
    "x VLLM_DP) and $JUDGE_GPUS for the judge (JUDGE_GPUS)." >&2
  exit 2
fi
LAST_PORT=$((VLLM_PORT + VLLM_SERVERS - 1))
if [ -n "$JUDGE_MODEL" ] && [ "$JUDGE_PORT" -ge "$VLLM_PORT" ] && [ "$JUDGE_PORT" -le "$LAST_PORT" ]; then
  echo "launch.sh: JUDGE_PORT=$JUDGE_PORT is one of the vLLM servers' ports ($VLLM_PORT to $LAST_PORT):" \
    "set JUDGE_PORT=$((LAST_PORT + 1))." >&2
  exit 2
fi
TRAIN_DEVICES=$(seq -s, 0 $((TRAIN_GPUS - 1)))
JUDGE_DEVICES=$(seq -s, "$TRAIN_GPUS" $((TRAIN_GPUS + JUDGE_GPUS - 1)))
VLLM_FIRST_GPU=$((TRAIN_GPUS + JUDGE_GPUS))
read_recipe "$@"  # MODEL, TOOL_FORMAT, USE_PEFT, LORA_R, FP16: the recipe's, or a trainer flag's
lora_server_flags  # LORA_ENV, LORA_ARGS: a LoRA recipe's server loads each synced adapter
server_dtype_flags  # DTYPE_ARGS: an fp16 recipe's server samples in float16
server_image_flags  # IMAGE_ARGS: a vision-language model's server takes images with token ids

vllm_cmd() {  # server $1 (0, 1, ...) on its own GPUs and port: sets VLLM_CMD and VLLM_DEVICES
  local first=$((VLLM_FIRST_GPU + $1 * SERVER_GPUS))
  VLLM_DEVICES=$(seq -s, "$first" $((first + SERVER_GPUS - 1)))
  VLLM_CMD=(env CUDA_VISIBLE_DEVICES="$VLLM_DEVICES" VLLM_SERVER_DEV_MODE=1 "${LORA_ENV[@]}"
    "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port $((VLLM_PORT + $1))
    --tensor-parallel-size "$VLLM_TP" --data-parallel-size "$VLLM_DP"
    --gpu-memory-utilization "$VLLM_GPU_MEMORY" --max-model-len "$VLLM_MAX_MODEL_LEN"
    --logprobs-mode processed_logprobs --generation-config vllm --weight-transfer-config '{"backend": "nccl"}'
    "${LORA_ARGS[@]}" "${DTYPE_ARGS[@]}" "${IMAGE_ARGS[@]}")
}
SERVER_FLAGS=(--vllm_server_host 127.0.0.1 --vllm_server_port "$VLLM_PORT")
if [ "$VLLM_SERVERS" -gt 1 ]; then
  # TRL's one-server fields back to their defaults: a recipe's vllm_server_host/port name one server, and
  # check_server_urls (mt_grpo/run/checks.py) refuses them beside vllm_server_urls
  SERVER_FLAGS=(--vllm_server_host 0.0.0.0 --vllm_server_port 8000 --vllm_server_urls)
  for ((i = 0; i < VLLM_SERVERS; i++)); do SERVER_FLAGS+=("http://127.0.0.1:$((VLLM_PORT + i))"); done
fi
JUDGE_CMD=() JUDGE_FLAGS=()
if [ -n "$JUDGE_MODEL" ]; then  # a plain server: the judge's weights never change, so no sync flags
  JUDGE_CMD=(env CUDA_VISIBLE_DEVICES="$JUDGE_DEVICES"
    "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$JUDGE_MODEL" --port "$JUDGE_PORT"
    --tensor-parallel-size "$JUDGE_GPUS" --gpu-memory-utilization "$JUDGE_GPU_MEMORY"
    --max-model-len "$JUDGE_MAX_MODEL_LEN")
  JUDGE_FLAGS=(--judge_base_url "http://127.0.0.1:$JUDGE_PORT/v1" --judge_model "$JUDGE_MODEL")
fi
TRAIN_CMD=(env CUDA_VISIBLE_DEVICES="$TRAIN_DEVICES"
  "$PYTHON" -m accelerate.commands.launch --config_file "$ACCELERATE_CONFIG" --num_processes "$TRAIN_GPUS"
  mt_grpo_trainer.py --config "$RECIPE" --generation_backend vllm_server
  "${SERVER_FLAGS[@]}" "${JUDGE_FLAGS[@]}" "$@")

if [ "$DRY_RUN" = 1 ]; then
  echo "# $RECIPE: tool_format $TOOL_FORMAT" >&2  # stderr: stdout is the commands
  for ((i = 0; i < VLLM_SERVERS; i++)); do vllm_cmd "$i"; echo "$(show "${VLLM_CMD[@]}") &"; done
  if [ -n "$JUDGE_MODEL" ]; then echo "$(show "${JUDGE_CMD[@]}") &"; fi
  HEALTH="http://127.0.0.1:$VLLM_PORT/health"
  for ((i = 1; i < VLLM_SERVERS; i++)); do HEALTH+=" and :$((VLLM_PORT + i))/health"; done
  echo "# wait for $HEALTH${JUDGE_MODEL:+ and :$JUDGE_PORT/health} (at most" \
    "${VLLM_HEALTH_TIMEOUT}s), then:"
  show "${TRAIN_CMD[@]}"
  exit 0
fi

SERVER_PIDS=()
for ((i = 0; i < VLLM_SERVERS; i++)); do vllm_cmd "$i"; "${VLLM_CMD[@]}" & SERVER_PIDS+=($!); done
if [ -n "$JUDGE_MODEL" ]; then "${JUDGE_CMD[@]}" & SERVER_PIDS+=($!); fi
cleanup() {
  local pid
  for pid in "${SERVER_PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "launch.sh: stopping a vLLM server (pid $pid)" >&2
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_healthy() {  # name, port, pid
  echo "launch.sh: waiting for the $1 server (port $2)..." >&2
  local deadline=$((SECONDS + VLLM_HEALTH_TIMEOUT))
  until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
    if ! kill -0 "$3" 2>/dev/null; then echo "launch.sh: the $1 server exited during start-up" >&2; exit 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then echo "launch.sh: the $1 server not healthy after ${VLLM_HEALTH_TIMEOUT}s" >&2; exit 1; fi
    sleep 5
  done
}
for ((i = 0; i < VLLM_SERVERS; i++)); do
  vllm_cmd "$i"; wait_healthy "vLLM (GPUs $VLLM_DEVICES)" $((VLLM_PORT + i)) "${SERVER_PIDS[i]}"
done
if [ -n "$JUDGE_MODEL" ]; then wait_healthy "judge (GPUs $JUDGE_DEVICES)" "$JUDGE_PORT" "${SERVER_PIDS[VLLM_SERVERS]}"; fi
echo "launch.sh: vLLM is up; training on GPUs $TRAIN_DEVICES" >&2
"${TRAIN_CMD[@]}"
