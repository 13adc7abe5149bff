# one call on a freshly lent 1 x H200 (2026-12-02): lora_accumulate against the step as it trains, 8 layers,
# three rounds of fresh processes (cuBLASLt preferred in two), parity, then one profiled step of each
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/lora_accumulate_h200_2026-12-02
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 LAYERS=8
{
for v in current accumulate cublaslt accumulate current cublaslt current accumulate; do
  timeout 80 python3 $D/layers.py layers $v > /tmp/run.log 2>&1
  echo "$(grep -E '^layers ' /tmp/run.log || tail -c 1500 /tmp/run.log)"
done
timeout 80 python3 $D/layers.py parity > /tmp/run.log 2>&1; echo "$(grep -E '^parity' /tmp/run.log || tail -c 1500 /tmp/run.log)"
} | tee $OUT/call1_output.txt
for v in current accumulate; do timeout 80 python3 $D/step_kernels.py $v > /tmp/out_$v.log 2>/tmp/err_$v.log; tail -1 /tmp/out_$v.log > $OUT/call1_kernels_$v.json; [ -s $OUT/call1_kernels_$v.json ] || tail -c 2000 /tmp/err_$v.log; done
python3 - <<'PY' | tee -a $OUT/call1_output.txt
import json, os
a = json.load(open(f"{os.environ['OUT']}/call1_kernels_current.json"))
b = json.load(open(f"{os.environ['OUT']}/call1_kernels_accumulate.json"))
print("kernel ms a step: current", a["total_ms"], "accumulate", b["total_ms"])
names = set(a["kernels"]) | set(b["kernels"])
for k in sorted(names, key=lambda k: -abs(b["kernels"].get(k, (0, 0))[0] - a["kernels"].get(k, (0, 0))[0]))[:25]:
    print(f"{a['kernels'].get(k, (0, 0))[0]:8.3f} {a['kernels'].get(k, (0, 0))[1]:4d}  {b['kernels'].get(k, (0, 0))[0]:8.3f} {b['kernels'].get(k, (0, 0))[1]:4d}  {k}")
PY
