# one call on a fresh 1 x H200 (2026-12-02): the fused base products through the custom op (fused_op) against
# current: parity, 8 layers in alternating fresh processes (3 rounds), then one profiled step of each
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri LAYERS=8
{
timeout 150 python3 $D/layers.py parity > /tmp/p.log 2>&1; grep -E "^parity " /tmp/p.log || tail -c 1500 /tmp/p.log
for v in fused_op current fused_op current fused_op current; do
  timeout 90 python3 $D/layers.py layers $v > /tmp/run.log 2>&1; grep -E "^layers " /tmp/run.log || tail -c 1500 /tmp/run.log
done
} | tee $OUT/call5_output.txt
for v in current fused_op; do timeout 150 python3 $D/step_kernels.py $v > /tmp/out_$v.log 2>/tmp/err_$v.log; tail -1 /tmp/out_$v.log > $OUT/call5_kernels_$v.json; [ -s $OUT/call5_kernels_$v.json ] || tail -c 2000 /tmp/err_$v.log; done
python3 - <<'PY'
import json, os
a, b = (json.load(open(f"{os.environ['OUT']}/call5_kernels_{v}.json")) for v in ("current", "fused_op"))
print("kernel ms a step: current", a["total_ms"], "fused_op", b["total_ms"])
names = set(a["kernels"]) | set(b["kernels"])
diff = sorted(names, key=lambda k: -abs(b["kernels"].get(k, (0, 0))[0] - a["kernels"].get(k, (0, 0))[0]))
for k in diff[:25]:
    print(f"{a['kernels'].get(k, (0, 0))[0]:8.3f} {a['kernels'].get(k, (0, 0))[1]:4d}  {b['kernels'].get(k, (0, 0))[0]:8.3f} {b['kernels'].get(k, (0, 0))[1]:4d}  {k}")
PY
