# one call: the op orderings, parity, then 8 layers with PEFT's LoRA, fused LoRA and no LoRA, three fresh processes each
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
S=bench/results/fused_lora_h200_2026-11-28/fused_lora_layers.py
timeout 60 python3 $S ops > $OUT/ops.log 2>&1; tail -c 3000 $OUT/ops.log
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_par TRITON_CACHE_DIR=/tmp/tri_par timeout 120 python3 $S parity > $OUT/parity.log 2>&1; tail -c 1500 $OUT/parity.log
export LAYERS=8
for r in 1 2 3; do for v in peft fused no_lora; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$v$r TRITON_CACHE_DIR=/tmp/tri_$v$r timeout 120 python3 $S layers $v $r > $OUT/layers_${v}_$r.log 2>&1
  grep -E "^layers " $OUT/layers_${v}_$r.log || tail -5 $OUT/layers_${v}_$r.log
done; done
