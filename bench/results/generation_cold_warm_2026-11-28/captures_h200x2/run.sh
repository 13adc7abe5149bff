# graph captures during the served bench's rounds: kv padding 1024 (the engine's) and 4096, one per GPU
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 \
  timeout 420 python3 gpu/captures.py $1 "$3" > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
run kv1024 0 '{}' & run kv4096 1 '{"kv_padding_interval_size": 4096}' & wait
tar czf $OUT/logs.tgz -C /tmp logs
grep -h "^kv" /tmp/logs/*.log
