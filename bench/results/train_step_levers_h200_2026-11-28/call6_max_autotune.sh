. bench/gpu_site.sh && install_site || exit 1
export LAYERS=4 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_at TRITON_CACHE_DIR=/tmp/tri_at
timeout 150 python3 gpu/lora_ceiling.py lora 1 > $OUT/lora4.log 2>&1; grep -E "^lora " $OUT/lora4.log
timeout 400 python3 gpu/lora_ceiling.py autotune 1 > $OUT/autotune4.log 2>&1; echo rc=$?; grep -E "^lora_max" $OUT/autotune4.log | cut -c1-300
grep -E "AUTOTUNE|^  (triton|mm|addmm|bmm|extern)" $OUT/autotune4.log | cut -c1-160 > $OUT/autotune_tables.txt; grep -c AUTOTUNE $OUT/autotune_tables.txt
