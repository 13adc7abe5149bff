# served with uvloop + httptools (uvicorn's "auto" picks them when installed) beside without, same code,
# on two GPUs, three rounds, GPUs swapped between rounds (temporary)
. bench/gpu_site.sh && install_site || exit 1
rm -rf /tmp/site_uv && python3 -m pip install -q --no-index --no-deps --target /tmp/site_uv gpu/whl_uv/*.whl || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs
run() { (CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=$3:$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 \
  TRITON_CACHE_DIR=/tmp/tri_$1 TORCH_LOGS=recompiles timeout 250 python3 -m bench.generation_speed --shared gpu/shared \
  --serving-only --new-tokens 128 --out $OUT/$1.json > /tmp/logs/$1.log 2>&1; echo "$1 rc=$? $(date +%T)"); }
PYTHONPATH=/tmp/site_uv:/tmp/site python3 -c "import uvloop, httptools; print('uv', uvloop.__version__, httptools.__version__)"
for r in 1 2 3; do
  if [ $r = 2 ]; then a=1; b=0; else a=0; b=1; fi
  run uv_r$r $a /tmp/site_uv:/tmp/site & run plain_r$r $b /tmp/site & wait
done
tar czf $OUT/logs.tgz -C /tmp logs
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_r*.json")):
    d = json.load(open(f))["by_new_tokens"]["128"]
    print(os.path.basename(f), round(d["single_stream_tokens_per_s"], 1), round(d.get("bandwidth_bound_tokens_per_s", 0), 1),
          {k: round(v["tokens_per_s"]) for k, v in d["concurrent"].items()},
          {k: round(v["ttft_p50_s"], 2) for k, v in d["concurrent"].items()})
PY
