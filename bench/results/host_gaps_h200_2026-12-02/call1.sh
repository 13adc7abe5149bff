# one call on a 1 x H200 (2026-12-02): where the trainer's idle GPU time goes (host-late or queued, by
# bench/step_profile.gap_split), and two inductor options aimed at the host's share, against the step as it
# trains; the checkpoint stage's trainer, 36 layers, micro-batch 4, synthetic batches; two rounds of fresh
# processes, the inductor cache cold in round 1
. bench/gpu_site.sh && install_site || exit 1
set -o pipefail
timeout 560 python3 -m bench.step_profile trainer_mb4 trainer_mb4_combo_kernels trainer_mb4_cpp_wrapper \
  trainer_mb4 trainer_mb4_combo_kernels trainer_mb4_cpp_wrapper --out $OUT/call1_step_profile.json 2>&1 \
  | grep -v -E "^\s*$|Warning|warn\(" | tee $OUT/call1_output.txt
