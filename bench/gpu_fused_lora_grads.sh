#!/usr/bin/env bash
# Issue 39 item 2's next measurement, in one call to a lent GPU (about 6 minutes with ROUNDS=2, the machine's
# start not counted): (1) bench/fused_lora_grads.py, LoRA's two backward products of each output gradient from
# one pass over it beside cuBLAS's two, on one Qwen3-8B layer's shapes, every tile config; (2)
# bench/step_profile.py through the checkpoint stage's trainer (36 Qwen3-8B-shaped layers, LoRA r16,
# micro-batch 4 x 2048, synthetic packed batches): the code as it stands (trainer_mb4) and with the fused
# products in (1)'s best config (trainer_mb4_fused_lora_grads), ROUNDS rounds alternating (default 2; 0: none),
# each a fresh process profiling one step (GPU time by kind of kernel, top kernels). Needs .whl/ carried beside
# the checkout (bench/gpu_scale.sh lists the wheels). Output and results under $OUT.
#
#   ROUNDS=2 bash bench/gpu_fused_lora_grads.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,serial --format=csv,noheader
. bench/gpu_site.sh && install_site || exit 1
timeout 100 python3 -m bench.fused_lora_grads $OUT/fused_lora_grads.json 2>&1 | grep -v -i warn \
  | tee $OUT/fused_lora_grads_output.txt
export FUSED_LORA_GRADS=$OUT/fused_lora_grads.json
v="trainer_mb4 trainer_mb4_fused_lora_grads"
[ "${ROUNDS:-2}" -gt 0 ] && timeout $((150 * ${ROUNDS:-2})) python3 -m bench.step_profile \
  $(for i in $(seq "${ROUNDS:-2}"); do echo $v; done) --out $OUT/step_profile.json 2>&1 | grep -v -i warn \
  | tee $OUT/step_profile_output.txt | cut -c1-400
