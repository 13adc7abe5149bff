#!/usr/bin/env bash
# The whole pipeline of a recipe on the lent GPU, resumable across calls on a warm machine:
# links the inputs recipes/qwen3_8b_shape.yaml names (Qwen3's tokenizer, GSM8K train; carried
# gzipped in gpu/, git-ignored), builds in the background (a call may end before the build
# does; the next call waits on the same build, or restarts it: stages are cached and training
# resumes from its last saved step), then verifies and writes bench/pipeline_report.py's figures.
#
# Needs, carried beside the checkout: .whl/ (the training wheels, as bench/gpu_scale.sh lists),
# gpu/whl_pipe/ (lm-eval 0.4.13, chardet, zstandard, amd-quark 0.13, onnxslim: the eval and
# quantized stages'), gpu/qwen3-tokenizer/ (its json and jinja files, tokenizer.json gzipped) and
# gpu/gsm8k-train.jsonl.gz. `doit verify` imports every stage's module for its check, the anchor
# stage's too, so verifying here needs web3's wheels as well; without them verify fails on that
# import and the build is rebuilt (a no-op: every stage is cached) rather than found "already built".
#
#   bash bench/gpu_pipeline.sh RECIPE SECONDS_TO_WAIT   (writes logs and the report under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_site.sh && install_site gpu/whl_pipe || exit 1
recipe=${1:-qwen3_8b_shape}; wait_s=${2:-560}; out=${OUT:-/tmp}
mkdir -p models/qwen3-tokenizer data/gsm8k
if [ ! -f models/qwen3-tokenizer/tokenizer.json ]; then
  cp gpu/qwen3-tokenizer/*.json gpu/qwen3-tokenizer/*.jinja models/qwen3-tokenizer/
  gunzip -c gpu/qwen3-tokenizer/tokenizer.json.gz > models/qwen3-tokenizer/tokenizer.json
  gunzip -c gpu/gsm8k-train.jsonl.gz > data/gsm8k/train.jsonl
fi
pidfile=/tmp/build-$recipe.pid
if ! { [ -f $pidfile ] && kill -0 "$(cat $pidfile)" 2>/dev/null; }; then
  if [ -f artifacts/$recipe/manifest.json ] && python3 -m doit verify:$recipe > /dev/null 2>&1; then
    echo "already built"
  else
    setsid nohup python3 -m doit manifest:$recipe >> /tmp/build-$recipe.log 2>&1 < /dev/null &
    echo $! > $pidfile
  fi
fi
start=$SECONDS
while [ -f $pidfile ] && kill -0 "$(cat $pidfile)" 2>/dev/null && (( SECONDS - start < wait_s )); do sleep 5; done
cp /tmp/build-$recipe.log "$out/" 2>/dev/null
for log in artifacts/store/*/*.log; do cp "$log" "$out/$(basename "$(dirname "$log")")-$(basename "$log")"; done
if [ -f $pidfile ] && kill -0 "$(cat $pidfile)" 2>/dev/null; then echo "still building"; exit 3; fi
python3 -m doit verify:$recipe 2>&1 | tail -3 | tee "$out/verify.txt"
python3 -m doit show:$recipe 2>&1 | tail -20 > "$out/show.txt"
python3 -m bench.pipeline_report "$recipe" --out "$out/pipeline_$recipe.json"
