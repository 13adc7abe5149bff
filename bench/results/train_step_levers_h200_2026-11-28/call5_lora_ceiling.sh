. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
export LAYERS=8
for r in 1 2 3; do for v in lora no_lora; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$v$r TRITON_CACHE_DIR=/tmp/tri_$v$r timeout 150 python3 gpu/lora_ceiling.py $v $r > $OUT/ceiling_${v}_$r.log 2>&1
  grep -E "^(lora|no_lora) " $OUT/ceiling_${v}_$r.log
done; done
