# Shell functions shared by launch.sh (one node) and scripts/slurm_launch.sh (several): sourced, not run.
# They read ROOT (the repository, where the trainer runs), RECIPE (the recipe's path) and PYTHON.

# Stops unless RECIPE is a file. A relative path is read from the current folder; one that names a recipe of the
# repository from elsewhere gets its absolute path as the fix. $1: the launcher's name.
check_recipe() {
  [ -f "$RECIPE" ] && return 0
  local fix=""
  if [[ $RECIPE != /* ]] && [ -f "$ROOT/$RECIPE" ]; then fix="; the repository's is $ROOT/$RECIPE"; fi
  echo "$1: recipe not found: $RECIPE (a relative path is read from $(pwd -P)$fix)" >&2
  exit 2
}

# The recipe's path as the trainer, run from ROOT, is given it: relative to ROOT when the recipe lies inside it, else
# absolute. A relative RECIPE is read from the caller's folder (the current one, before the launcher moves to ROOT).
recipe_path() {
  local dir=. name=$RECIPE path
  if [[ $RECIPE == */* ]]; then dir=${RECIPE%/*} name=${RECIPE##*/}; dir=${dir:-/}; fi
  path=$(cd "$dir" && pwd -P)/$name
  case $path in "$ROOT"/*) echo "${path#"$ROOT"/}" ;; *) echo "$path" ;; esac
}

# MODEL, TOOL_FORMAT, USE_PEFT, LORA_R and FP16 from the recipe and the trainer flags ($@) as the trainer reads them:
# scripts/recipe_values.py parses the recipe with PyYAML (quoting, YAML's booleans, CRLF files), a flag overriding it.
read_recipe() {
  local values
  command -v "$PYTHON" >/dev/null || {
    echo "launch: PYTHON=$PYTHON not found: set PYTHON to the interpreter with vllm, trl and accelerate" >&2; exit 2; }
  values=$("$PYTHON" "$ROOT/scripts/recipe_values.py" "$RECIPE" "$@") || exit 2
  eval "$values"
}

# LoRA (use_peft true in the recipe or among the flags): the server loads each synced adapter at run time
# (lora_sync: adapter), of rank up to lora_r (TRL's default 16) rounded up to a rank vLLM accepts; two versions
# loaded at once (async_rollout keeps the previous one until its batch ends).
# Sets LORA_ENV and LORA_ARGS (empty for a full-weight recipe). Needs read_recipe's USE_PEFT and LORA_R.
lora_server_flags() {
  local r max_rank=""
  LORA_ENV=() LORA_ARGS=()
  [ "$USE_PEFT" = "true" ] || return 0
  for r in 1 8 16 32 64 128 256 320 512; do
    if [ "$r" -ge "$LORA_R" ]; then max_rank=$r; break; fi
  done
  [ -n "$max_rank" ] || { echo "launch: lora_r $LORA_R is above 512, the largest rank vLLM serves" >&2; exit 2; }
  LORA_ENV=(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
  LORA_ARGS=(--enable-lora --max-lora-rank "$max_rank" --max-loras 2)
}

# FP16 (fp16 true in the recipe or among the flags): the servers sample in float16 too, else in the checkpoint's
# dtype (docs/guide.md, "Mixed precision"). Sets DTYPE_ARGS. Needs read_recipe's FP16.
server_dtype_flags() {
  DTYPE_ARGS=(); if [ "$FP16" = "true" ]; then DTYPE_ARGS=(--dtype float16); fi
}

server_image_flags() {  # IMAGE_ARGS: a vision-language model's server takes images with token ids (its folder has an
  # image processor, or VLLM_IMAGES=1 for a hub id): /inference/v1/generate, mt_grpo/engine/server_images.py; and it
  # processes them with the PIL image processor, as the trainer does (transformers picks torchvision's otherwise)
  IMAGE_ARGS=()
  if [ "${VLLM_IMAGES:-}" = "1" ] || [ -f "$MODEL/preprocessor_config.json" ]; then
    IMAGE_ARGS=(--mm-processor-kwargs '{"use_fast": false}' --enable-scale-out)
  fi
}

show() {  # print a command so that it can be pasted into a shell
  local out=() a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_,./:=+@-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
