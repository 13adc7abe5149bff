# one call on a lent 1 x H200 (2026-12-02), after call 1 (the collator's block mask +0.5% in both rounds, the
# GPU still waiting on BlockMask.from_kv_blocks's eager transposes before the first layer): the query-side
# blocks now found on the CPU too; the same two variants, two rounds of fresh processes, baseline first
. bench/gpu_site.sh && install_site || exit 1
set -o pipefail
V="trainer_mb4_model_mask trainer_mb4"
timeout 540 python3 -m bench.step_profile $V $V --out $OUT/call2_step_profile.json 2>&1 \
  | grep -E "^(trainer|bf16|Traceback|[A-Za-z]*Error)" | tee $OUT/call2_output.txt
