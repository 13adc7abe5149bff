# one call on a 1 x H200 (2026-12-02): call 1 again with each member's forward a closure (call 1's functools.partial
# broke the layer's graph at every shared member), separate and shared alternating, 3 rounds of fresh processes
# (the inductor cache shared after round 1), graph breaks counted
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
S=bench/results/lora_shared_input_h200_2026-11-29/layers.py
export LAYERS=8 TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2
for r in 1 2 3; do for v in separate shared; do
  TORCH_LOGS=graph_breaks timeout 100 python3 $S layers $v > /tmp/l.log 2>&1
  echo "$(grep -E '^layers ' /tmp/l.log || tail -c 1500 /tmp/l.log) graph_breaks=$(grep -c 'Graph break' /tmp/l.log)"
done; done | tee $OUT/call2_output.txt
