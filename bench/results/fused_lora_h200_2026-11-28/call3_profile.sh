# third call: CUDA kernel times of 8 layers with PEFT's LoRA and without LoRA (torch.profiler), one process
. bench/gpu_site.sh && install_site || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
LAYERS=8 timeout 200 python3 bench/results/fused_lora_h200_2026-11-28/kernel_profile.py > $OUT/kernel_profile.log 2>&1; tail -c 6000 $OUT/kernel_profile.log
