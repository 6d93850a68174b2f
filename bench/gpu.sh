#!/usr/bin/env bash
# One script for a GPU machine, under 8 minutes on one H100/H200-class GPU:
#   1. ResNet-50, 224 px, bf16, channels_last: images/s and MFU (FLOPs counted by
#      torch.utils.flop_counter, the GPU's dense bf16 peak from ddpflow/efficiency.py)
#   2. a small CIFAR-shaped network (ResNet-18, 32 px): images/s
#   3. tuned vs untuned batch size for ResNet-50: `ddpflow tune`, then both trained
#   4. DDP vs DP and 1 vs N GPUs where the machine has several (bench/ddp_vs_dp.py)
# Usage: bash bench/gpu.sh [outdir]   (results/*.json and a summary table in outdir)
set -euo pipefail
out=${1:-bench-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
cfg() {  # name model size batch steps -> a config file
  cat >"$out/$1.yaml" <<CONF
run: $1
results_dir: $out/results
log_every_steps: 10
data: {train_size: ${6:-16384}, val_size: 512, image_size: $3, loader: device}
model: {name: $2}
hardware: {device: cuda, nproc_per_node: 1}
checkpoint: {every_steps: 0, resume: never}
tune: {steps: 5, start_batch: 64, max_batch: 1024}
stages:
  - {name: s, max_steps: $5, batch_size: $4, precision: bf16, channels_last: true, lr: 0.1}
CONF
  echo "$out/$1.yaml"
}
show() { $py - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    s = json.load(open(path))
    mfu = s.get("mfu")
    print(f"{path}: {s['mean_samples_per_s']:.0f} images/s, batch {s['batch_size_per_rank']}, "
          f"MFU {'-' if mfu is None else f'{mfu:.1%}'}, {s['mean_tflops'] or 0:.1f} TFLOP/s, "
          f"data wait {s['data_wait_fraction']:.1%}")
PY
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
$py -m ddpflow doctor | tee "$out/doctor.txt"

c=$(cfg rn50 resnet50 224 256 60 8192); $py -m ddpflow prepare -c "$c" >/dev/null
timeout 150 $py -m ddpflow launch -c "$c" --stage s
c=$(cfg rn18 resnet18 32 512 200); $py -m ddpflow prepare -c "$c" >/dev/null
timeout 90 $py -m ddpflow launch -c "$c" --stage s
c=$(cfg rn50auto resnet50 224 auto 60 8192); $py -m ddpflow prepare -c "$c" >/dev/null
timeout 150 $py -m ddpflow tune -c "$c" && timeout 90 $py -m ddpflow launch -c "$c" --stage s
c=$(cfg rn50small resnet50 224 32 60 8192); $py -m ddpflow prepare -c "$c" >/dev/null
timeout 60 $py -m ddpflow launch -c "$c" --stage s
if [ "$($py -c 'import torch; print(torch.cuda.device_count())')" -gt 1 ]; then
  timeout 120 $py bench/ddp_vs_dp.py --steps 40 | tee "$out/ddp_vs_dp.txt"
fi
echo "== summary"
show "$out"/results/*/stages/s/summary.json | tee "$out/summary.txt"
