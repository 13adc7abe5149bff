# one call on a 1 x H200 (2026-12-02), with the shared A product in stages/train/lora_scale.py: the checkpoint
# stage's trainer, 36 layers, micro-batch 4 (bench/step_profile.py), one A product per projection
# (trainer_mb4_separate_a) against shared (trainer_mb4, as it now trains), alternating fresh processes
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
timeout 370 python3 -m bench.step_profile trainer_mb4_separate_a trainer_mb4 trainer_mb4_separate_a trainer_mb4 \
  --out $OUT/call3_step_profile.json 2>&1 | grep --line-buffered -E "^(bf16|trainer)" | cut -c1-300 | tee $OUT/call3_output.txt
