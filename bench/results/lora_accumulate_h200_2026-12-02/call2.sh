# one call on a lent 1 x H200 (2026-12-02), after call 1 (8 layers: lora_accumulate 1.56 ms less kernel time a
# step, medians -2.5, -2.2, +2.4 ms): the checkpoint stage's trainer at 36 layers, the step as it trains against
# lora_accumulate, two rounds of fresh processes, baseline first; then why the layers' CUDA graphs do not replay
# under the trainer (the reasons inductor's cudagraph trees log)
. bench/gpu_site.sh && install_site || exit 1
set -o pipefail
V="trainer_mb4 trainer_mb4_accumulate"
timeout 330 python3 -m bench.step_profile $V $V --out $OUT/call2_step_profile.json 2>&1 \
  | grep -E "^(trainer|bf16|Traceback|[A-Za-z]*Error)" | tee $OUT/call2_output.txt
TORCH_LOGS="perf_hints,cudagraphs,recompiles" timeout 200 python3 -m bench.step_profile trainer_mb4_cudagraphs_marked \
  --out $OUT/call2_graphs.json > /tmp/graphs.log 2>&1
gzip -c /tmp/graphs.log > $OUT/call2_graphs_log.gz
grep -E "^trainer" /tmp/graphs.log | tee -a $OUT/call2_output.txt
grep -v -E "^\s" /tmp/graphs.log | grep -i -E "cudagraph|record|skipping|recompil|static|warm" | sed -E 's/[0-9a-f]{8,}//g' \
  | sort | uniq -c | sort -rn | head -40 | cut -c1-400 | tee -a $OUT/call2_output.txt
