. bench/gpu_site.sh && install_site || exit 1
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 \
  timeout 400 python3 gpu/async_prof.py $1 "$3" > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
run sync 0 '{}' & run async 1 '{"use_async_batching": true}' & wait
tar czf $OUT/logs.tgz -C /tmp logs
grep -h "^sync\|^async\|profiled\|ready" /tmp/logs/*.log
