# one call on a lent 1 x H200 (2026-12-05), run three times one after another on one machine (bash call.sh r1, r2,
# r3): bench/train_speed.py's short run (ours, ours_safe, TRL's best configuration) with the code as it stands
# (lora_accumulate in the trainer since b92a034); the same 1,440 rows (BLAKE3 b59f21d81782, bench/data_prep.py's
# make_real_rows), Qwen3's tokenizer, cold caches in each run (its own work directory and compile caches)
# Carry [".whl", "gpu"], which bench/gpu_wheels.sh makes on a fresh checkout.
run=${1:?run name}
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,serial --format=csv,noheader
python3 -c "import torch, transformers, peft, trl, pyarrow; print(torch.__version__, transformers.__version__, peft.__version__, trl.__version__, pyarrow.__version__)"
gunzip -c gpu/rows1440.jsonl.gz > /tmp/rows.jsonl
[ -e /tmp/ts_$run ] && { echo "/tmp/ts_$run exists: not a fresh run"; exit 1; }
ls -d /tmp/ts_r* 2>/dev/null | sed 's/^/earlier run on this machine: /'
timeout 570 python3 -m bench.train_speed /tmp/$run.json --work /tmp/ts_$run --rows /tmp/rows.jsonl \
  --tokenizer gpu/shared/tokenizers/qwen3 --trl trl_flex_nogc_compile > /tmp/$run.log 2>&1
echo "exit $?"
grep -v -i -E "warn|it/s\]|s/it\]" /tmp/$run.log | tail -30
grep -c -i "has no attribute 'to'" /tmp/$run.log | sed 's/^/Liger RMSNorm compile errors in the log: /'
gzip -c /tmp/$run.log > $OUT/train_speed_${run}_log.gz
cp /tmp/$run.json $OUT/train_speed_$run.json
