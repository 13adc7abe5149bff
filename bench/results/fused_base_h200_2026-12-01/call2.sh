# one call on a fresh 1 x H200: the checkpoint stage's trainer at micro-batch 4 (bench/step_profile.py
# trainer variants, 36 layers), as it trains and with the compiled layers under CUDA graphs, three rounds
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
timeout 560 python3 -m bench.step_profile trainer_mb4 trainer_mb4_cudagraphs_marked trainer_mb4 \
  trainer_mb4_cudagraphs_marked trainer_mb4 trainer_mb4_cudagraphs_marked --out $OUT/step_profile.json 2>&1 \
  | grep -E "^(bf16|trainer)" | cut -c1-600
