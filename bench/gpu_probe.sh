#!/usr/bin/env bash
# bench/autotune_probe.py on a lent GPU, cold: each run gets fresh inductor and Triton caches, in
# its own process, one after another; results and logs under $OUT. Needs .whl/ carried beside the
# checkout (transformers 5.23, peft, ...). With OLD=<dir> holding another checkout's stages/ and
# bench/, that code's probe runs once first, the same way (the search it replaces, side by side).
#
#   bash bench/gpu_probe.sh 3 --shape qwen3-8b --global-batch 8 --budget 300
. bench/gpu_site.sh && install_site || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
runs=$1; shift
cold() {  # NAME DIR ARGS...: one cold probe of the code in DIR
  local name=$1 dir=$2; shift 2
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$dir \
    timeout "${LIMIT:-400}" python3 -m bench.autotune_probe "$@" --out "${OUT:-/tmp}/probe_$name.json" \
    > "${OUT:-/tmp}/probe_$name.log" 2>&1
  echo "$name rc=$? $(grep -E '^decisions|probe [0-9]+ s' "${OUT:-/tmp}/probe_$name.log" | tr '\n' ' ')"
}
[ -n "$OLD" ] && (cd "$OLD" && cold old "$OLD" "$@")
for i in $(seq 1 "$runs"); do cold "run$i" "$PWD" "$@"; done
