# one call on a fresh 1 x H200: parity of the fused base products, then 8 layers of each variant
# in fresh processes, three rounds alternating (round 1 compiles cold; the inductor cache is shared)
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri LAYERS=8
run() {  # ARGS...: one process; its result line into results.jsonl, a failure's log tail into failures.txt
  timeout "${T:-150}" python3 $D/layers.py "$@" > /tmp/run.log 2>&1
  line=$(grep -E "^(layers|parity) " /tmp/run.log) && echo "$line" | tee -a $OUT/results.jsonl \
    || { echo "FAILED $*"; { echo "== $*"; tail -c 3000 /tmp/run.log; } >> $OUT/failures.txt; }
}
T=150 run parity
for r in 1 2 3; do for v in current fused graphs fused_graphs; do T=120 run layers $v; done; done
