# one call on a fresh 1 x H200: fused with the group's product split (one concatenation in the backward) against
# current, 8 layers, alternating fresh processes (the inductor cache shared)
. bench/gpu_site.sh && install_site || exit 1
D=bench/results/fused_base_h200_2026-12-01
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri LAYERS=8
for v in fused current fused current; do
  timeout 70 python3 $D/layers.py layers $v > /tmp/run.log 2>&1; grep -E "^layers " /tmp/run.log || tail -c 1500 /tmp/run.log
done
