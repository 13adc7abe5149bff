# one call on a lent 1 x H200 (2026-12-02), after call 2: bench/train_speed.py on real text with the collator's
# document mask, the short run (ours, ours_safe, TRL's best configuration); the same 1,440 rows (BLAKE3
# b59f21d81782), Qwen3's tokenizer, cold caches
. bench/gpu_site.sh && install_site || exit 1
gunzip -c gpu/rows1440.jsonl.gz > /tmp/rows.jsonl
rm -rf /tmp/ts /tmp/ts.json
timeout 560 python3 -m bench.train_speed /tmp/ts.json --work /tmp/ts --rows /tmp/rows.jsonl \
  --tokenizer gpu/shared/tokenizers/qwen3 --trl trl_flex_nogc_compile 2>&1 | grep -v -i -E "warn|it/s\]|s/it\]" | tail -40
cp /tmp/ts.json $OUT/train_speed.json 2>/dev/null || cp /tmp/ts/*.json $OUT/ 2>/dev/null
