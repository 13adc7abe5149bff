# the served bench (cold first round + warm rounds) at kv padding 1024 (the engine's) beside 4096, three fresh
# runs each, GPUs swapped between rounds
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 \
  timeout 280 python3 -m bench.generation_speed --shared gpu/shared --serving-only --new-tokens 128 --rounds 3 $3 \
  --out $OUT/$1.json > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
for r in 1 2 3; do
  if [ $r = 2 ]; then a=1; b=0; else a=0; b=1; fi
  run kv1024_r$r $a "" & run kv4096_r$r $b "--option kv_padding_interval_size=4096" & wait
done
tar czf $OUT/logs.tgz -C /tmp logs
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_r*.json")):
    d = json.load(open(f)); d = d["by_new_tokens"]["128"]
    print(os.path.basename(f), "1:", round(d["single_stream_tokens_per_s"], 1), round(d["single_stream_warm_tokens_per_s"], 1),
          "bound", round(d.get("bandwidth_bound_tokens_per_s", 0), 1),
          {k: (round(v["tokens_per_s"]), round(v["warm_tokens_per_s"])) for k, v in d["concurrent"].items()},
          {k: round(v["ttft_p50_s"], 2) for k, v in d["concurrent"].items()})
PY
