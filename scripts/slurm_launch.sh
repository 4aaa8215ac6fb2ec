#!/usr/bin/env bash
# MT-GRPO on several nodes under SLURM, from one command: vLLM servers on the last VLLM_NODES nodes of the
# allocation, `accelerate launch` on the others, and the trainer pointed at every server (vllm_server_urls: each
# group goes to one server, the weights reach all; mt_grpo/engine/server_pool.py).
#
#   sbatch --nodes=4 --gpus-per-node=8 --exclusive scripts/slurm_launch.sh RECIPE.yaml [trainer flags...]
#   scripts/slurm_launch.sh --dry-run RECIPE.yaml [trainer flags...]   # inside an allocation (salloc), or with
#                                                                      # SLURM_JOB_NODELIST set: each node's commands
#
# Settings (environment variables, with defaults):
#   VLLM_NODES=1               nodes that serve generation (the allocation's last ones); the others train
#   GPUS_PER_NODE=$SLURM_GPUS_ON_NODE, else 8
#   VLLM_TP=1                  GPUs per vLLM server (tensor parallel); each vLLM node runs GPUS_PER_NODE / VLLM_TP
#                              servers, on ports VLLM_PORT, VLLM_PORT+1, ...
#   VLLM_PORT=8000 VLLM_GPU_MEMORY=0.9 VLLM_MAX_MODEL_LEN=4096 VLLM_HEALTH_TIMEOUT=900   as in launch.sh
#   MAIN_PORT=29500            accelerate's main process port, on the first training node
#   NCCL_PORT=51216            the NCCL weight sync's rendezvous on the first training node: server i uses NCCL_PORT+i
#   ACCELERATE_CONFIG=accelerate_configs/zero3_multinode.yaml   (its machine_rank, main_process_ip, num_machines and
#                              num_processes are overridden per node)
#   PYTHON=python              interpreter with vllm, trl and accelerate installed (and so PyYAML), on every node
#   MT_GRPO_ROOT=              the repository. sbatch runs a copy of this script from its spool folder, so unless
#                              this is set the repository is this script's parent folder when run in place (salloc,
#                              --dry-run), else the folder sbatch was called from (SLURM_SUBMIT_DIR). The trainer
#                              runs from it; a relative RECIPE is read from the folder the script started in.
# The node list comes from `scontrol show hostnames`, or, where scontrol is absent, from SLURM_JOB_NODELIST expanded
# here (names like gpu[01-04,09],cpu7: one bracket per name). A LoRA recipe's servers get launch.sh's LoRA flags,
# an fp16 recipe's their --dtype float16.
# Everything started is stopped when training ends, fails, or the job is cancelled (the trap below).
#SBATCH --job-name=mt-grpo
#SBATCH --ntasks-per-node=1
set -euo pipefail
is_repository() { [ -f "$1/mt_grpo_trainer.py" ] && [ -f "$1/scripts/launch_common.sh" ]; }
if [ -n "${MT_GRPO_ROOT:-}" ]; then
  is_repository "$MT_GRPO_ROOT" || { echo "slurm_launch.sh: MT_GRPO_ROOT=$MT_GRPO_ROOT is not the mt-grpo" \
    "repository (no mt_grpo_trainer.py and scripts/launch_common.sh there)" >&2; exit 2; }
  ROOT=$MT_GRPO_ROOT
elif is_repository "$(dirname "${BASH_SOURCE[0]}")/.."; then
  ROOT=$(dirname "${BASH_SOURCE[0]}")/..
elif [ -n "${SLURM_SUBMIT_DIR:-}" ] && is_repository "$SLURM_SUBMIT_DIR"; then
  ROOT=$SLURM_SUBMIT_DIR
else
  echo "slurm_launch.sh: cannot find the mt-grpo repository: sbatch runs a copy of this script, and the folder it" \
    "was submitted from (SLURM_SUBMIT_DIR=${SLURM_SUBMIT_DIR:-}) is not the repository. Set MT_GRPO_ROOT to it:" \
    "MT_GRPO_ROOT=/path/to/mt-grpo sbatch ... /path/to/mt-grpo/scripts/slurm_launch.sh RECIPE.yaml" >&2
  exit 2
fi
ROOT=$(cd "$ROOT" && pwd -P)
source "$ROOT/scripts/launch_common.sh"  # check_recipe, recipe_path, read_recipe, *_flags, show

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
RECIPE=${1:?usage: scripts/slurm_launch.sh [--dry-run] RECIPE.yaml [trainer flags...]}
shift
check_recipe slurm_launch.sh
RECIPE=$(recipe_path)
cd "$ROOT"  # the trainer runs from the repository (srun steps start in this folder)
[ -n "${SLURM_JOB_NODELIST:-}" ] || { echo "slurm_launch.sh: SLURM_JOB_NODELIST is not set: submit with sbatch," \
  "run inside salloc, or set it (e.g. SLURM_JOB_NODELIST='gpu[1-4]') for --dry-run." >&2; exit 2; }

VLLM_NODES=${VLLM_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
VLLM_TP=${VLLM_TP:-1}
VLLM_PORT=${VLLM_PORT:-8000}
VLLM_GPU_MEMORY=${VLLM_GPU_MEMORY:-0.9}
VLLM_MAX_MODEL_LEN=${VLLM_MAX_MODEL_LEN:-4096}
VLLM_HEALTH_TIMEOUT=${VLLM_HEALTH_TIMEOUT:-900}
MAIN_PORT=${MAIN_PORT:-29500}
NCCL_PORT=${NCCL_PORT:-51216}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_configs/zero3_multinode.yaml}
PYTHON=${PYTHON:-python}

expand_nodelist() {  # gpu[01-03,07],cpu7 -> one name a line, as `scontrol show hostnames` prints them
  local list=$1 items=() cur="" depth=0 c k item prefix suffix r lo hi i
  for ((k = 0; k < ${#list}; k++)); do
    c=${list:k:1}
    case $c in "[") depth=1 ;; "]") depth=0 ;; esac
    if [ "$c" = "," ] && [ "$depth" = 0 ]; then items+=("$cur"); cur=""; else cur+=$c; fi
  done
  items+=("$cur")
  for item in "${items[@]}"; do
    if [[ $item =~ ^([^][]*)\[([^][]*)\]([^][]*)$ ]]; then
      prefix=${BASH_REMATCH[1]} suffix=${BASH_REMATCH[3]}
      IFS=, read -ra ranges <<<"${BASH_REMATCH[2]}"
      for r in "${ranges[@]}"; do
        if [[ $r == *-* ]]; then
          lo=${r%-*} hi=${r#*-}
          for ((i = 10#$lo; i <= 10#$hi; i++)); do printf '%s%0*d%s\n' "$prefix" "${#lo}" "$i" "$suffix"; done
        else
          echo "$prefix$r$suffix"
        fi
      done
    elif [[ $item == *[][]* ]]; then
      echo "slurm_launch.sh: cannot expand '$item' without scontrol (one bracket per name)" >&2; exit 2
    else
      echo "$item"
    fi
  done
}
if command -v scontrol >/dev/null; then
  NODE_LINES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  NODE_LINES=$(expand_nodelist "$SLURM_JOB_NODELIST") || exit 2
fi
mapfile -t NODES <<<"$NODE_LINES"

TRAIN_NODES=$((${#NODES[@]} - VLLM_NODES))
if [ "$VLLM_NODES" -lt 1 ] || [ "$TRAIN_NODES" -lt 1 ]; then
  echo "slurm_launch.sh: ${#NODES[@]} node(s) (${NODES[*]}) and VLLM_NODES=$VLLM_NODES: at least one node must" \
    "serve and one train; allocate more nodes or change VLLM_NODES." >&2
  exit 2
fi
if [ $((GPUS_PER_NODE % VLLM_TP)) != 0 ]; then
  echo "slurm_launch.sh: VLLM_TP=$VLLM_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE: each vLLM node runs" \
    "GPUS_PER_NODE / VLLM_TP servers." >&2
  exit 2
fi
MAIN_NODE=${NODES[0]}
read_recipe "$@"  # MODEL, USE_PEFT, LORA_R, FP16: the recipe's, or a trainer flag's
lora_server_flags
server_dtype_flags
server_image_flags

# The servers: GPUS_PER_NODE / VLLM_TP on each vLLM node, one srun step each, on its own GPUs and port
SERVER_NODES=() SERVER_CMDS=() URLS=()
for node in "${NODES[@]:TRAIN_NODES}"; do
  for ((s = 0; s < GPUS_PER_NODE / VLLM_TP; s++)); do
    port=$((VLLM_PORT + s))
    SERVER_NODES+=("$node")
    URLS+=("http://$node:$port")
    SERVER_CMDS+=("$(show srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap \
      env CUDA_VISIBLE_DEVICES="$(seq -s, $((s * VLLM_TP)) $(((s + 1) * VLLM_TP - 1)))" VLLM_SERVER_DEV_MODE=1 \
      "${LORA_ENV[@]}" "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 0.0.0.0 \
      --port "$port" --tensor-parallel-size "$VLLM_TP" --gpu-memory-utilization "$VLLM_GPU_MEMORY" \
      --max-model-len "$VLLM_MAX_MODEL_LEN" --logprobs-mode processed_logprobs --generation-config vllm \
      --weight-transfer-config '{"backend": "nccl"}' "${LORA_ARGS[@]}" "${DTYPE_ARGS[@]}" "${IMAGE_ARGS[@]}")")
  done
done
# The training nodes: one accelerate launch each, with its machine rank; node 0 hosts the main process and the
# NCCL weight-sync rendezvous. TRL's one-server fields go back to their defaults: a recipe's
# vllm_server_host/port name one server, and check_server_urls (mt_grpo/run/checks.py) refuses them beside
# vllm_server_urls.
TRAIN_CMDS=()
for ((rank = 0; rank < TRAIN_NODES; rank++)); do
  TRAIN_CMDS+=("$(show srun --nodes=1 --ntasks=1 --nodelist="${NODES[rank]}" --overlap \
    "$PYTHON" -m accelerate.commands.launch --config_file "$ACCELERATE_CONFIG" --num_machines "$TRAIN_NODES" \
    --num_processes $((TRAIN_NODES * GPUS_PER_NODE)) --machine_rank "$rank" --main_process_ip "$MAIN_NODE" \
    --main_process_port "$MAIN_PORT" mt_grpo_trainer.py --config "$RECIPE" --generation_backend vllm_server \
    --vllm_server_host 0.0.0.0 --vllm_server_port 8000 --vllm_server_urls "${URLS[@]}" --nccl_master_address "$MAIN_NODE" --nccl_master_port "$NCCL_PORT" "$@")")
done

if [ "$DRY_RUN" = 1 ]; then
  for i in "${!SERVER_CMDS[@]}"; do
    echo "# ${SERVER_NODES[i]}: vLLM server ${URLS[i]}"
    echo "${SERVER_CMDS[i]} &"
  done
  echo "# wait for ${URLS[*]/%//health} (at most ${VLLM_HEALTH_TIMEOUT}s), then:"
  for ((rank = 0; rank < TRAIN_NODES; rank++)); do
    echo "# ${NODES[rank]}: training, machine_rank $rank"
    echo "${TRAIN_CMDS[rank]} &"
  done
  echo "# wait for the training steps; on exit, failure or cancel, stop every step"
  exit 0
fi

PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
  done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "slurm_launch.sh: stopped every step" >&2
}
trap cleanup EXIT
trap 'exit 130' INT TERM

SERVER_PIDS=()
for cmd in "${SERVER_CMDS[@]}"; do
  eval "$cmd" &
  PIDS+=($!) SERVER_PIDS+=($!)
done
deadline=$((SECONDS + VLLM_HEALTH_TIMEOUT))
for i in "${!URLS[@]}"; do
  echo "slurm_launch.sh: waiting for ${URLS[i]}..." >&2
  until curl -sf "${URLS[i]}/health" >/dev/null; do
    if ! kill -0 "${SERVER_PIDS[i]}" 2>/dev/null; then echo "slurm_launch.sh: ${URLS[i]} exited during start-up" >&2; exit 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then echo "slurm_launch.sh: ${URLS[i]} not healthy after ${VLLM_HEALTH_TIMEOUT}s" >&2; exit 1; fi
    sleep 5
  done
done
echo "slurm_launch.sh: ${#URLS[@]} vLLM server(s) up; training on ${NODES[*]:0:TRAIN_NODES}" >&2
TRAIN_PIDS=()
for cmd in "${TRAIN_CMDS[@]}"; do
  eval "$cmd" &
  PIDS+=($!) TRAIN_PIDS+=($!)
done
for _ in "${TRAIN_PIDS[@]}"; do  # the first training step that fails ends the job (the trap stops the rest)
  wait -n "${TRAIN_PIDS[@]}" || { status=$?; echo "slurm_launch.sh: a training step failed ($status)" >&2; exit "$status"; }
done
