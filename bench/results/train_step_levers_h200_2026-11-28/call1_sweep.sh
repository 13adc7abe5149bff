. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
timeout 200 python3 gpu/flex_sweep.py > $OUT/flex_sweep.log 2>&1; echo "flex rc=$?"
tail -5 $OUT/flex_sweep.log
KOPTS=$(cat $OUT/best_opts.json 2>/dev/null) timeout 330 python3 gpu/layer_sweep.py > $OUT/layer_sweep.log 2>&1; echo "layer rc=$?"
grep -v "^\s*$" $OUT/layer_sweep.log | grep -E "^(ours|no_lora|kernel|max)" 
