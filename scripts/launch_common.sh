# Shell functions shared by launch.sh (one node) and scripts/slurm_launch.sh (several): sourced, not run.
# They read RECIPE (the recipe's path) and the trainer flags passed to them.

recipe_value() { awk -F': *' -v key="$1" '$1 == key {print $2; exit}' "$RECIPE" | sed 's/[[:space:]]*#.*//'; }
flag_value() { local key=$1; shift; local prev=""; for a in "$@"; do [ "$prev" = "--$key" ] && echo "$a"; prev=$a; done; }

# LoRA (use_peft: true in the recipe, or --use_peft true among the flags): the server loads each synced
# adapter at run time (lora_sync: adapter), of rank up to lora_r (TRL's default 16) rounded up to a rank
# vLLM accepts; two versions loaded at once (async_rollout keeps the previous one until its batch ends).
# Sets LORA_ENV and LORA_ARGS (empty for a full-weight recipe). Arguments: the trainer flags.
lora_server_flags() {
  local use_peft lora_r r max_rank=""
  LORA_ENV=() LORA_ARGS=()
  use_peft=$(flag_value use_peft "$@"); use_peft=${use_peft:-$(recipe_value use_peft)}
  [ "$use_peft" = "true" ] || return 0
  lora_r=$(flag_value lora_r "$@"); lora_r=${lora_r:-$(recipe_value lora_r)}; lora_r=${lora_r:-16}
  for r in 1 8 16 32 64 128 256 320 512; do
    if [ "$r" -ge "$lora_r" ]; then max_rank=$r; break; fi
  done
  [ -n "$max_rank" ] || { echo "launch: lora_r $lora_r is above 512, the largest rank vLLM serves" >&2; exit 2; }
  LORA_ENV=(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
  LORA_ARGS=(--enable-lora --max-lora-rank "$max_rank" --max-loras 2)
}

# FP16 (fp16: true in the recipe or among the flags): the servers sample in float16 too, else in the checkpoint's
# dtype (docs/guide.md, "Mixed precision"). Sets DTYPE_ARGS. Arguments: the trainer flags.
server_dtype_flags() {
  local fp16
  fp16=$(flag_value fp16 "$@"); fp16=${fp16:-$(recipe_value fp16)}
  DTYPE_ARGS=(); if [ "$fp16" = "true" ]; then DTYPE_ARGS=(--dtype float16); fi
}

show() {  # print a command so that it can be pasted into a shell
  local out=() a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_,./:=+@-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
