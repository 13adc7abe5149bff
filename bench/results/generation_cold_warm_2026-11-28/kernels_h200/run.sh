# GPU kernel time per decode step, engine alone (no HTTP), warm: one stream and 32 at once (sync, as served)
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_k TRITON_CACHE_DIR=/tmp/tri_k timeout 300 python3 gpu/async_prof.py engine '{}' 2>&1 | grep -v "^\[" | grep "engine\|profiled\|ready\|Error" 
