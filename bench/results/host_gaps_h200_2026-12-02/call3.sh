# one call on a freshly lent 1 x H200 (2026-12-02): bench/train_speed.py on real text with the shared A product
# (landed 2026-12-02), the short run for the device time left: ours (the probe, then training), ours_safe (the
# loss check) and TRL's best configuration of every earlier run (flex + Liger, no checkpointing, torch_compile);
# the same 1,440 rows as the runs of 2026-11-26 and 2026-11-29 (BLAKE3 b59f21d81782), cold caches
. bench/gpu_site.sh && install_site || exit 1
gunzip -c gpu/rows1440.jsonl.gz > /tmp/rows.jsonl
timeout 520 python3 -m bench.train_speed /tmp/ts.json --work /tmp/ts --rows /tmp/rows.jsonl \
  --tokenizer gpu/shared/tokenizers/qwen3 --trl trl_flex_nogc_compile 2>&1 | grep -v -i -E "warn|it/s\]|s/it\]" | tail -40
cp /tmp/ts.json $OUT/call3_train_speed.json 2>/dev/null || cp /tmp/ts/*.json $OUT/ 2>/dev/null
