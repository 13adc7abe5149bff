. bench/gpu_site.sh && install_site || exit 1
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 KV=$4 \
  timeout 280 python3 gpu/async_prof.py $1 "$3" > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
run async64k 0 '{"use_async_batching": true}' 65536 & run sync64k 1 '{}' 65536 & wait
run async16k 1 '{"use_async_batching": true, "max_batch_tokens": 512}' 16384 & run sync16k 0 '{"max_batch_tokens": 512}' 16384 & wait
tar czf $OUT/logs.tgz -C /tmp logs
grep -h "^sync\|^async\|ready" /tmp/logs/*.log
