# one call on a 1 x H200 (2026-12-02), after call 6's logs: each fused member's forward a closure, not a
# functools.partial (which broke the layer's graph at every member); fused_op, fused (split) and current,
# 8 layers, 3 rounds of fresh processes, then one profiled step of each fused variant
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind7 TRITON_CACHE_DIR=/tmp/tri7 LAYERS=8
{
for v in fused_op fused current fused_op fused current fused_op fused current; do
  TORCH_LOGS="graph_breaks" timeout 90 python3 $D/layers.py layers $v > /tmp/run.log 2>&1
  echo "$(grep -E '^layers ' /tmp/run.log || tail -c 1500 /tmp/run.log) graph_breaks=$(grep -c 'Graph break' /tmp/run.log)"
done
} | tee $OUT/call7_output.txt
for v in current fused fused_op; do timeout 150 python3 $D/step_kernels.py $v > /tmp/out_$v.log 2>/tmp/err_$v.log; tail -1 /tmp/out_$v.log > $OUT/call7_kernels_$v.json; [ -s $OUT/call7_kernels_$v.json ] || tail -c 2000 /tmp/err_$v.log; done
python3 - <<'PY' | tee -a $OUT/call7_output.txt
import json, os
a = json.load(open(f"{os.environ['OUT']}/call7_kernels_current.json"))
for v in ("fused", "fused_op"):
    b = json.load(open(f"{os.environ['OUT']}/call7_kernels_{v}.json"))
    print("kernel ms a step: current", a["total_ms"], v, b["total_ms"])
    names = set(a["kernels"]) | set(b["kernels"])
    diff = sorted(names, key=lambda k: -abs(b["kernels"].get(k, (0, 0))[0] - a["kernels"].get(k, (0, 0))[0]))
    for k in diff[:15]:
        print(f"{a['kernels'].get(k, (0, 0))[0]:8.3f} {a['kernels'].get(k, (0, 0))[1]:4d}  {b['kernels'].get(k, (0, 0))[0]:8.3f} {b['kernels'].get(k, (0, 0))[1]:4d}  {k}")
PY
