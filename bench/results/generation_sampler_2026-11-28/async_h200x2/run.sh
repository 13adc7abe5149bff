# async batching (transformers 5.23) beside the default, one round each at once (temporary)
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=/tmp/site:$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 \
  TRITON_CACHE_DIR=/tmp/tri_$1 timeout 280 python3 -m bench.generation_speed --shared gpu/shared \
  --serving-only --new-tokens 128 $3 --out $OUT/$1.json > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
run async 1 "--option use_async_batching=true" & run sync 0 "" & wait
tar czf $OUT/logs.tgz -C /tmp logs
grep -n -i -B2 -A12 "error in generation loop\|Traceback" /tmp/logs/async.log | head -60
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f))["by_new_tokens"]["128"]
    print(os.path.basename(f), round(d.get("single_stream_tokens_per_s", 0), 1),
          {k: round(v["tokens_per_s"]) for k, v in d.get("concurrent", {}).items()})
PY
