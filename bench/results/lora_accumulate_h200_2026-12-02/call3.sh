# one call on a lent 1 x H200 (2026-12-02), after call 2 (36 layers through the trainer: lora_accumulate 7.5 and
# 15 ms a step faster; the layers' CUDA graphs recorded again in every step because the block mask's tensors came
# at new addresses): the layers under CUDA graphs with the block mask's tensors held at one address
# (document_mask.Held), then the step as it trains (trainer_mb4, lora_accumulate by now), one process each
. bench/gpu_site.sh && install_site || exit 1
TORCH_LOGS="cudagraphs" timeout 170 python3 -m bench.step_profile trainer_mb4_graphs_held \
  --out $OUT/call3_graphs_held.json > /tmp/g.log 2>&1
grep -E "^(bf16|trainer|Traceback|[A-Za-z]*Error)" /tmp/g.log | cut -c1-900 | tee -a $OUT/call3_output.txt
echo "graphs: data pointer changed $(grep -c 'data pointer changed' /tmp/g.log), lines naming a recording $(grep -c -i 'record' /tmp/g.log)" | tee -a $OUT/call3_output.txt
gzip -c /tmp/g.log > $OUT/call3_graphs_log.gz
timeout 130 python3 -m bench.step_profile trainer_mb4 --out $OUT/call3_trainer_mb4.json 2>&1 \
  | grep -E "^(trainer|Traceback|[A-Za-z]*Error)" | cut -c1-900 | tee -a $OUT/call3_output.txt
