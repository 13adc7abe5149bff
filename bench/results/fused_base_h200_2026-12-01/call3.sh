# one call on a fresh 1 x H200: one profiled step of current and of fused (8 layers), then their kernels side by side
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri LAYERS=8
for v in current fused; do timeout 200 python3 $D/step_kernels.py $v > /tmp/out_$v.log 2>/tmp/err_$v.log; tail -1 /tmp/out_$v.log > $OUT/profile_$v.json; [ -s $OUT/profile_$v.json ] || tail -c 2000 /tmp/err_$v.log; done
python3 - <<'PY'
import json, os
a, b = (json.load(open(f"{os.environ['OUT']}/profile_{v}.json")) for v in ("current", "fused"))
print("kernel ms a step: current", a["total_ms"], "fused", b["total_ms"])
names = set(a["kernels"]) | set(b["kernels"])
diff = sorted(names, key=lambda k: -abs(b["kernels"].get(k, (0, 0))[0] - a["kernels"].get(k, (0, 0))[0]))
for k in diff[:25]:
    print(f"{a['kernels'].get(k, (0, 0))[0]:8.3f} {a['kernels'].get(k, (0, 0))[1]:4d}  {b['kernels'].get(k, (0, 0))[0]:8.3f} {b['kernels'].get(k, (0, 0))[1]:4d}  {k}")
PY
