# one call on a freshly lent 1 x H200 (2026-12-02), after call 1 (host-late time in the forward; cpp_wrapper
# fails to compile; combo kernels faster in one round of two): combo kernels and dynamo's guards skipped after
# the warm-up, alone and together, against the step as it trains; rounds of fresh processes until the limit
. bench/gpu_site.sh && install_site || exit 1
set -o pipefail
V="trainer_mb4 trainer_mb4_combo_kernels trainer_mb4_skip_guards trainer_mb4_combo_skip_guards"
timeout 570 python3 -m bench.step_profile $V $V $V --out $OUT/call2_step_profile.json 2>&1 \
  | grep -E "^(trainer|bf16|Traceback|[A-Za-z]*Error)" | tee $OUT/call2_output.txt
