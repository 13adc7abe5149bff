# one call on a lent 1 x H200 (2026-12-02): the checkpoint stage's trainer (36 layers, micro-batch 4, synthetic
# packed batches) with the collator's flex block mask (trainer_mb4, stages/train/document_mask.py) against the
# model finding the documents itself (trainer_mb4_model_mask, the code before); two rounds of fresh processes,
# baseline first in each
. bench/gpu_site.sh && install_site || exit 1
set -o pipefail
V="trainer_mb4_model_mask trainer_mb4"
timeout 540 python3 -m bench.step_profile $V $V --out $OUT/call1_step_profile.json 2>&1 \
  | grep -E "^(trainer|bf16|Traceback|[A-Za-z]*Error)" | tee $OUT/call1_output.txt
