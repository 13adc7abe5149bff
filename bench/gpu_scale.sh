#!/usr/bin/env bash
# bench/scale.py in one call to a lent multi-GPU machine, resumable on a warm one: the project,
# its store and the results stay under /tmp/scale between calls (a machine idle for 30 s goes
# back, so put the runs that belong together in one call). Needs, carried beside the checkout:
#   .whl/  the wheels the GPU image lacks or has at other versions (transformers 5.23,
#          huggingface-hub 2.4, tokenizers, trl, peft, datasets, dill, multiprocess, fsspec, doit,
#          blake3, datasketch, pydantic(+core), ... as docs/distributed.md's "Measured" section ran)
#   gpu/scale_rows.jsonl.gz  bench/data_prep.make_real_rows(path, 3000), gzipped
#   gpu/shared/tokenizers/qwen3  Qwen3's tokenizer
# A training process that outlives HANG seconds (default 240) gets SIGABRT, and with
# PYTHONFAULTHANDLER its threads' tracebacks land in the stage log: a hang shows where it hangs.
# Past TRACE seconds (default 150) each of our training processes gets SIGUSR1 every minute: its
# threads' stacks in the stage log, and it goes on (stages/train/distributed.py registers the
# signal; torchrun and the peer's processes, which do not, are not sent it), so a run cut by the
# call's limit still says where its time went.
# A 14B full fine-tune's process lives longer than that without hanging (loading, 10 steps, the
# save of its weights: about 2 minutes on 4 x H200): give it HANG=400 or more.
#
#   LIMIT=540 bash bench/gpu_scale.sh --workloads 8b_lora --gpus 1,2,4 --sides ours,fsdp2@4,peer@4   (results
#   and logs under $OUT; the wheels are installed once per machine, under /tmp/site; NAME=x keeps
#   this call's results in x.json, apart from other settings' on the same warm machine)
. bench/gpu_site.sh && install_site || exit 1
[ -f /tmp/rows.jsonl ] || gunzip -c gpu/scale_rows.jsonl.gz > /tmp/rows.jsonl
if [ -d /tmp/scale/project ]; then rm -rf /tmp/scale/project/stages; cp -r stages /tmp/scale/project/; fi
( n=0; while sleep 15; do n=$((n + 1)); for p in $(pgrep -f "stages.train.distributed|peer-child"); do
    age=$(ps -o etimes= -p "$p" | tr -d ' ')
    if [ "$age" -gt "${HANG:-240}" ]; then kill -ABRT "$p"
    elif [ "$age" -gt "${TRACE:-150}" ] && [ $((n % 4)) -eq 0 ] && grep -q stages.train.distributed /proc/$p/cmdline \
         && ! grep -q torch.distributed.run /proc/$p/cmdline; then kill -USR1 "$p"; fi; done; done ) >/dev/null 2>&1 &
watchdog=$!  # its output goes nowhere: it would hold a pipe after this script (| tail) open for ever
timeout "${LIMIT:-540}" python3 -m bench.scale "$@" --work /tmp/scale --rows /tmp/rows.jsonl \
  --tokenizer gpu/shared/tokenizers/qwen3 --out /tmp/scale/${NAME:-scale}.json 2>&1 | grep -v -i warn | tail -30
cp /tmp/scale/${NAME:-scale}.json "${OUT:-/tmp}/"; tail -c 200000 /tmp/scale/builds.log > "${OUT:-/tmp}/builds.log"
c=/tmp/scale/project/artifacts/store/checkpoint  # a build still running logs to .tmp-<key>-<pid>.log
for f in $(ls -t $c/*.log $c/.tmp-*.log 2>/dev/null | head -3); do
  grep -v -i warn "$f" | tail -c 20000 > "${OUT:-/tmp}/$(basename "$f")"; done
kill "$watchdog"
