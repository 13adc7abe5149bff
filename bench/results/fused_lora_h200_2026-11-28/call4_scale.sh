# fourth call: LoRA's scale in B's weight (stages/train/lora_scale.py): parity, then 8 layers with PEFT's LoRA and
# with the scale in the weight, three fresh processes each, alternating
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
S=bench/results/fused_lora_h200_2026-11-28/fused_lora_layers.py
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_par TRITON_CACHE_DIR=/tmp/tri_par timeout 120 python3 $S parity scaled > $OUT/parity.log 2>&1; tail -c 1500 $OUT/parity.log
export LAYERS=8
for r in 1 2 3; do for v in peft scaled; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$v$r TRITON_CACHE_DIR=/tmp/tri_$v$r timeout 100 python3 $S layers $v $r > $OUT/layers_${v}_$r.log 2>&1
  grep -E "^layers " $OUT/layers_${v}_$r.log || tail -5 $OUT/layers_${v}_$r.log
done; done
