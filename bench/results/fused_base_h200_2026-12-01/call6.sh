# one call on the same 1 x H200 (2026-12-02): why fused_op's wall time is 13-14 ms above current's while its kernels
# are 2.7 ms above: graph breaks and recompiles of each (dynamo's logs), and each step's CPU-side time
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri LAYERS=8
for v in current fused_op; do
  TORCH_LOGS="graph_breaks,recompiles" timeout 120 python3 $D/layers.py layers $v > /tmp/log_$v.txt 2>&1
  echo "== $v: $(grep -c 'Graph break' /tmp/log_$v.txt) graph-break lines, $(grep -ci 'recompil' /tmp/log_$v.txt) recompile lines"
  grep -E "^layers " /tmp/log_$v.txt
  grep -iE -A3 "graph break|recompil" /tmp/log_$v.txt | head -40
done | tee $OUT/call6_output.txt
