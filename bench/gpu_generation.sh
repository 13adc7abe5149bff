#!/usr/bin/env bash
# bench/generation_speed.py on a lent GPU, one run per NAME and its arguments, results and logs
# under $OUT. Needs, carried beside the checkout: .whl/ (transformers 5.23 and what the served app
# and its OpenAI clients import: fastapi, starlette, uvicorn, sse-starlette, openai, httpx2,
# httpcore2, pydantic(+core), ...) and gpu/shared/ (tokenizers/qwen3, datasets/mt-bench, datasets/gsm8k).
#
#   bash bench/gpu_generation.sh default "--new-tokens 128" kv256 "--new-tokens 128 --option kv_padding_interval_size=256"
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  # shellcheck disable=SC2086
  timeout "${LIMIT:-280}" python3 -m bench.generation_speed --shared gpu/shared $args \
    --out "${OUT:-/tmp}/generation_speed_$name.json" > "${OUT:-/tmp}/$name.log" 2>&1
  echo "$name rc=$? $(grep -v -i warn "${OUT:-/tmp}/$name.log" | tail -c 300)"
done
