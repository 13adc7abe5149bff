# one call on a fresh 1 x H200: parity, then 8 layers with one A product per projection (separate) and with A's
# product shared per input (shared), three fresh processes each, alternating, each with cold compile caches
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
S=bench/results/lora_shared_input_h200_2026-11-29/layers.py
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_par TRITON_CACHE_DIR=/tmp/tri_par timeout 120 python3 $S parity > $OUT/parity.log 2>&1; tail -c 800 $OUT/parity.log
export LAYERS=8
for r in 1 2 3; do for v in separate shared; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$v$r TRITON_CACHE_DIR=/tmp/tri_$v$r timeout 100 python3 $S layers $v > $OUT/layers_${v}_$r.log 2>&1
  grep -E "^layers " $OUT/layers_${v}_$r.log || tail -5 $OUT/layers_${v}_$r.log
done; done
