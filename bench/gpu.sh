#!/usr/bin/env bash
# The GPU machine's script: correctness checks (PASS/FAIL each) on the paths no CPU can run,
# then figures, in under 8 minutes on one H100/H200-class GPU. Run it first whenever a GPU
# machine is at hand, fix what fails, and paste the table it ends with into docs/BENCHMARKS.md.
#   bash bench/gpu.sh [outdir]          (logs, summaries and table.md in outdir)
# Checks:
#   env            torch is a CUDA build; NVML (nvidia-ml-py) answers; a C compiler for Triton
#   doctor         `ddpflow doctor` names the GPU and the driver (NVML, matched by UUID)
#   rn50_bf16      ResNet-50 224 px bf16 channels_last on the device loader (chunked upload):
#                  finished, NCCL, FLOPs/sample 20-28 G, MFU in (2%, 70%), GPU utilisation read
#   fp16_resume    fp16 + GradScaler + grad clip + accumulation, pinned DataLoader: halted at
#                  a checkpoint (exit 75), resumed, finite loss, skipped steps counted
#   determinism    deterministic: true twice on the device loader and once on the DataLoader:
#                  the same weights all three times (every tensor of final.pt's "model" and
#                  "model_raw", torch.equal; the files also hold the run's name and config)
#   compile        compile: true builds graphs (compiled_graphs > 0) and counts its FLOPs
#   tune           `ddpflow tune --memory-cap-mb 3072`: a batch that then trains
#   nondeterministic  a model with a CUDA op that has no deterministic kernel (bilinear
#                  interpolate's backward, in torch.use_deterministic_algorithms's list of ops
#                  that raise), deterministic: true: one message naming the op, exit 2, no
#                  traceback
# Figures: ResNet-50 bf16 (channels_last and not), ResNet-18 32 px; table.md at the end.
set -uo pipefail
out=${1:-bench-gpu-out}
py=${PYTHON:-python3}
# no GPU, no checks: every one of them would fail (or, worse, pass on the CPU paths)
if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
  echo "bench/gpu.sh needs a CUDA GPU and a CUDA build of torch ($py sees none); it ran no" \
       "checks. Run it on the GPU machine; on this one, run the test suite instead." >&2
  exit 3
fi
rm -rf "$out"; mkdir -p "$out"
fails=0
check() {  # name command...: PASS/FAIL with the seconds it took; the log in $out/<name>.log
  local name=$1 t0=$SECONDS; shift
  if "$@" >"$out/$name.log" 2>&1; then echo "PASS $name ($((SECONDS - t0)) s)"
  else echo "FAIL $name ($((SECONDS - t0)) s): $(grep -E 'Error|error|FAIL|assert' \
      "$out/$name.log" | tail -2 | tr '\n' ' ')"; fails=$((fails + 1)); fi
}
cfg() {  # name model px train_size "data extras" "stage" ["top-level extras"] -> config path
  cat >"$out/$1.yaml" <<CONF
run: $1
results_dir: $out/results
log_every_steps: 10
${7:-}
data: {train_size: $4, val_size: 512, image_size: $3, $5}
model: {name: $2}
hardware: {device: cuda, nproc_per_node: 1}
checkpoint: {every_steps: 0, every_epochs: 0, resume: auto}
tune: {steps: 3, start_batch: 64, max_batch: 4096}
stages:
  - {name: s, lr: 0.1, $6}
CONF
  $py -m ddpflow prepare -c "$out/$1.yaml" >/dev/null && echo "$out/$1.yaml"
}
summary() { echo "$out/results/$1/stages/s/summary.json"; }
holds() {  # summary.json "python expression over s": prints the figures, true if it holds
  $py - "$@" <<'PY'
import json, math, sys
s = json.load(open(sys.argv[1]))
print({k: s.get(k) for k in ("finished", "backend", "loader", "mean_samples_per_s", "mfu",
                             "flops_per_sample", "peak_flops_per_gpu", "gpu_util",
                             "compiled_graphs", "skipped_steps", "rank_weight_sha256")})
sys.exit(0 if eval(sys.argv[2], {"math": math}, {"s": s}) else 1)
PY
}

c_env() {
  $py -c "import torch, pynvml; pynvml.nvmlInit(); assert torch.cuda.is_available() and \
torch.version.cuda; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), \
pynvml.nvmlSystemGetDriverVersion())" && command -v cc
}
c_doctor() {
  local o; o=$($py -m ddpflow doctor) || return 1; echo "$o"
  grep -q "NCCL" <<<"$o" && grep -q "^driver " <<<"$o"
}
c_rn50() {  # also the headline figure
  local c; c=$(cfg rn50 resnet50 224 8192 "loader: device" \
    "max_steps: 80, batch_size: 256, precision: bf16, channels_last: true") || return 1
  timeout 200 $py -m ddpflow launch -c "$c" --stage s && holds "$(summary rn50)" \
    "s['finished'] and s['backend'] == 'nccl' and s['loader'] == 'device' and \
20e9 < s['flops_per_sample'] < 28e9 and 0.02 < s['mfu'] < 0.7 and s['gpu_util'] is not None"
}
c_fp16() {
  local c; c=$(cfg fp16 resnet18 32 8192 "loader: dataloader, num_workers: 2, pin_memory: true" \
    "max_steps: 40, batch_size: 128, grad_accum_steps: 2, grad_clip: 1.0, precision: fp16") \
    || return 1
  timeout 120 $py -m ddpflow launch -c "$c" --stage s --halt-after-steps 20; [ $? -eq 75 ] || return 1
  timeout 120 $py -m ddpflow launch -c "$c" --stage s 2>&1 | tee "$out/fp16-resume.txt"
  grep -q "resumed from" "$out/fp16-resume.txt" && holds "$(summary fp16)" \
    "s['finished'] and s['steps'] == 40 and 0 <= s['skipped_steps'] < 40 and \
math.isfinite(s['final_train_loss'])"
}
same_weights() {  # final.pt files: the same tensors under "model" (and "model_raw")
  $py - "$@" <<'PY'
import sys
import torch
first, *others = (torch.load(f, map_location="cpu", weights_only=True) for f in sys.argv[1:])
bad = [(i, part, k) for i, other in enumerate(others, 1) for part in ("model", "model_raw")
       if part in first or part in other
       for k in sorted(set(first.get(part, {})) | set(other.get(part, {})))
       if k not in first.get(part, {}) or k not in other.get(part, {})
       or not torch.equal(first[part][k], other[part][k])]
print(f"{len(first['model'])} tensors; differing:", bad[:5] or "none")
sys.exit(1 if bad else 0)
PY
}
c_det() {
  local f=() run loader c
  for run in det1:device det2:dataloader det3:device; do loader=${run#*:}; run=${run%%:*}
    c=$(cfg "$run" resnet18 32 8192 "loader: $loader, num_workers: 2, pin_memory: true" \
      "max_steps: 20, batch_size: 128, precision: fp32" "deterministic: true") || return 1
    timeout 120 $py -m ddpflow launch -c "$c" --stage s || return 1
    f+=("$out/results/$run/stages/s/final.pt")
  done
  echo "device, dataloader, device again:"
  same_weights "${f[@]}"
}
c_compile() {
  local c; c=$(cfg comp resnet18 32 8192 "loader: device" \
    "max_steps: 40, batch_size: 256, precision: bf16, channels_last: true, compile: true") \
    || return 1
  timeout 240 $py -m ddpflow launch -c "$c" --stage s && holds "$(summary comp)" \
    "s['compiled_graphs'] >= 1 and s['flops_per_sample'] > 0 and s['mfu'] is not None"
}
c_tune() {  # a 3 GiB cap (the allocator's, on a GPU): the batch search meets real OOMs
  local c; c=$(cfg tune resnet18 64 40000 "loader: auto" \
    "max_steps: 20, batch_size: auto, precision: auto") || return 1
  timeout 240 $py -m ddpflow tune -c "$c" --memory-cap-mb 3072 || return 1
  cat "$out/results/tune/tune.json"
  timeout 120 $py -m ddpflow launch -c "$c" --stage s
}
c_nondet() {
  mkdir -p "$out/code"
  cat >"$out/code/nondet_model.py" <<'PY'
import torch
from torch import nn


def build(num_classes, in_channels):
    # bilinear interpolate's CUDA backward (upsample_bilinear2d_backward) has no deterministic
    # kernel: torch.use_deterministic_algorithms lists it among the ops that raise
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, 8, 3)
            self.fc = nn.Linear(8, num_classes)

        def forward(self, x):
            h = torch.nn.functional.interpolate(self.conv(x), scale_factor=2, mode="bilinear",
                                                align_corners=False)
            return self.fc(h.mean((2, 3)))
    return Net()
PY
  local c; c=$(cfg nondet smallcnn 32 2048 "loader: device" \
    "max_steps: 5, batch_size: 64, precision: fp32" "deterministic: true") || return 1
  sed -i "s|model: {name: smallcnn}|model: {name: 'nondet_model:build', code_dir: '$out/code'}|" "$c"
  timeout 120 $py -m ddpflow launch -c "$c" --stage s 2>"$out/nondet.err"; local rc=$?
  cat "$out/nondet.err"
  [ $rc -eq 2 ] && grep -q "deterministic" "$out/nondet.err" && ! grep -q "Traceback" "$out/nondet.err"
}
figures() {  # channels_last against not, and a small-image model
  local c
  c=$(cfg rn50nchw resnet50 224 8192 "loader: device" \
    "max_steps: 80, batch_size: 256, precision: bf16, channels_last: false") &&
    timeout 200 $py -m ddpflow launch -c "$c" --stage s
  c=$(cfg rn18 resnet18 32 16384 "loader: device" \
    "max_steps: 200, batch_size: 512, precision: bf16, channels_last: true") &&
    timeout 120 $py -m ddpflow launch -c "$c" --stage s
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
check env c_env
check doctor c_doctor
check rn50_bf16 c_rn50
check fp16_resume c_fp16
check determinism c_det
check compile c_compile
check tune c_tune
check nondeterministic c_nondet
figures >"$out/figures.log" 2>&1 || echo "(a figure run failed: $out/figures.log)"
echo "== $fails check(s) failed; logs in $out"
echo "== table for docs/BENCHMARKS.md ($(git rev-parse --short HEAD 2>/dev/null), $(cat "$out/gpu.txt"))"
$py "$(dirname "$0")/gpu_table.py" "$out"/results/*/stages/s/summary.json | tee "$out/table.md"
exit "$fails"
