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
#   fp16_resume    fp16 + GradScaler + grad clip + accumulation, pinned DataLoader, on 2 ranks
#                  (NCCL) where there are 2 GPUs: halted at a checkpoint (exit 75), resumed;
#                  a model that plants an inf in its gradient at 4 known steps (2 before the
#                  halt, 2 after): skipped_steps == 4 exactly, finite loss
#   ranks_<part>_<backend>  bench/gpu_ranks.py on 2 ranks: gloo with both ranks on GPU 0
#                  (gloo takes CUDA tensors), and nccl with a rank per GPU where there are 2:
#                  every collective ddpflow calls, DDP with no_sync and accumulation, the
#                  gradient hook, fp16 skipped steps across ranks, SyncBatchNorm, compile
#                  with DDP (each exact against a plain model; see that file)
#   export_cuda    `ddpflow export` on a GPU machine runs the TorchScript file on the GPU too
#                  (checked_on cpu and cuda), and a model that makes a tensor in forward
#                  (the trace bakes its CPU device in) fails that check by name
#   layout_probe   channels_last: auto on the GPU probes at the stage's batch: a model that
#                  calls .view on a feature map trains in NCHW (reason names the failure)
#   determinism    deterministic: true twice on the device loader and once on the DataLoader:
#                  the same weights all three times (every tensor of final.pt's "model" and
#                  "model_raw", torch.equal; the files also hold the run's name and config)
#   compile        compile: true builds graphs (compiled_graphs > 0) and counts its FLOPs
#   tune           `ddpflow tune --memory-cap-mb 3072`: a batch that then trains
#   fsdp           strategy fsdp + activation checkpointing (ViT-B/16, 224 px, bf16) on NCCL,
#                  a rank per GPU: halted at a sharded checkpoint (exit 75), resumed from it
#                  (`resumed from ckpt-000000020.dcp`), 12 blocks checkpointed; figure: peak
#                  memory per rank and samples/s against DDP of the same model; with 2 GPUs
#                  or more, FSDP's peak must be at most 0.6 of DDP's
#   flight_recorder  NCCL's flight recorder as the launcher sets it up: a collective stuck behind
#                  a spinning kernel times out, the dump is written in ranks/ and the launcher's
#                  NCCL report names it (bench/gpu_flight.py; one GPU is enough)
#   sampling_resume  data.sampling balanced + data.augment.policy trivialaugment on the device
#                  loader (the policy on the GPU), deterministic: halted at step 15 and resumed
#                  gives the same weights as straight through
#   nondeterministic  a model with a CUDA op that has no deterministic kernel (the first of four
#                  in torch.use_deterministic_algorithms's list of ops that raise that does
#                  raise on this torch), deterministic: true: one message naming the op, exit
#                  2, no traceback
# Each check prints one line: PASS/FAIL name (seconds): its figure (the log's last "figure:"
# line, else its last line). What this machine could not run is listed as NOT EXERCISED.
# Figures: ResNet-50 bf16 (channels_last and not), ResNet-18 32 px; table.md at the end.
# GPU_DEADLINE_S=N: no check starts after N seconds (it is listed NOT RUN), so a lease's time
# limit still leaves the table; GPU_ARCHIVE=file.tgz: the logs and summaries packed there
# after each check (what a killed run leaves).
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
here=$(cd "$(dirname "$0")" && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")
nproc=$((gpus >= 2 ? 2 : 1))
skipped=()
notrun=()
archive() {  # the logs, summaries and reports so far (not the data) into $GPU_ARCHIVE
  [ -n "${GPU_ARCHIVE:-}" ] || return 0
  (cd "$out" && find . \( -name '*.log' -o -name '*.txt' -o -name '*.md' -o -name '*.json' \
    -o -name '*.yaml' -o -name '*.err' -o -name 'nccl_trace_rank_*' -o -name 'stack-*' \) \
    -size -4M -print0 | tar czf "$GPU_ARCHIVE.part" --null -T - && mv "$GPU_ARCHIVE.part" "$GPU_ARCHIVE")
}
check() {  # name command...: one line, PASS/FAIL with its seconds and figure; status 77: the
  local name=$1 t0=$SECONDS fig rc; shift  # check could not run here (NOT EXERCISED)
  if [ "${GPU_DEADLINE_S:-0}" -gt 0 ] && [ $SECONDS -ge "${GPU_DEADLINE_S}" ]; then
    notrun+=("$name"); echo "NOT RUN $name (past GPU_DEADLINE_S=$GPU_DEADLINE_S)"; return; fi
  "$@" >"$out/$name.log" 2>&1; rc=$?
  fig=$(grep -E '^figure: ' "$out/$name.log" | tail -1 | cut -c9-)
  [ -n "$fig" ] || fig=$(grep -v '^[[:space:]]*$' "$out/$name.log" | tail -1)
  fig=${fig:0:220}
  if [ $rc -eq 0 ]; then echo "PASS $name ($((SECONDS - t0)) s): $fig"
  elif [ $rc -eq 77 ]; then skipped+=("$name: $fig")
  else echo "FAIL $name ($((SECONDS - t0)) s): $fig $(grep -E 'Error|error|FAIL|assert' \
      "$out/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"; fails=$((fails + 1)); fi
  archive
}
cfg() {  # name model px train_size "data extras" "stage" ["top-level extras"] [ranks]
         # -> config path
  cat >"$out/$1.yaml" <<CONF
run: $1
results_dir: $out/results
log_every_steps: 10
${7:-}
data: {train_size: $4, val_size: 512, image_size: $3, $5}
model: {name: $2}
hardware: {device: cuda, nproc_per_node: ${8:-1}}
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
print("figure:", {k: s.get(k) for k in ("finished", "backend", "loader", "mean_samples_per_s", "mfu",
                             "flops_per_sample", "peak_flops_per_gpu", "gpu_util",
                             "compiled_graphs", "skipped_steps", "steps")})
sys.exit(0 if eval(sys.argv[2], {"math": math}, {"s": s}) else 1)
PY
}

c_env() {
  command -v cc && $py -c "import torch, pynvml; pynvml.nvmlInit(); \
assert torch.cuda.is_available() and torch.version.cuda; print('figure:', torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0), pynvml.nvmlSystemGetDriverVersion())"
}
c_doctor() {
  local o; o=$($py -m ddpflow doctor) || return 1; echo "$o"
  echo "figure: $(grep -m1 "^driver " <<<"$o")"
  grep -q "NCCL" <<<"$o" && grep -q "^driver " <<<"$o"
}
c_rn50() {  # also the headline figure
  local c; c=$(cfg rn50 resnet50 224 4096 "loader: device" \
    "max_steps: 80, batch_size: 256, precision: bf16, channels_last: true") || return 1
  timeout 200 $py -m ddpflow launch -c "$c" --stage s && holds "$(summary rn50)" \
    "s['finished'] and s['backend'] == 'nccl' and s['loader'] == 'device' and \
20e9 < s['flops_per_sample'] < 28e9 and 0.02 < s['mfu'] < 0.7 and s['gpu_util'] is not None"
}
plant_model() {  # code_dir/planted.py: a small CNN whose gradient gets an inf at known steps
  mkdir -p "$out/code"
  cat >"$out/code/planted.py" <<'PY'
import torch
from torch import nn


class Plant(torch.autograd.Function):
    """Identity forward; its backward (one per micro-batch, counted per process) multiplies
    the gradient by inf at calls 10 and 30: with 2 micro-batches per step, steps 5 and 15
    of each process, so the GradScaler must skip exactly those steps."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        n, Plant.calls = Plant.calls, Plant.calls + 1
        return g * float("inf") if n % 20 == 10 else g


def build(num_classes, in_channels):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, 16, 3, padding=1)
            self.fc = nn.Linear(16, num_classes)

        def forward(self, x):
            h = torch.relu(self.conv(x)).mean((2, 3))
            # small logits: scaled gradients far from fp16's limit, so no step overflows
            # except the planted ones
            return Plant.apply(0.01 * self.fc(h))
    return Net()
PY
}
c_fp16() {  # 40 steps, halted after 20: steps 5, 15 (first process) and 25, 35 (resumed)
  plant_model
  local c; c=$(cfg fp16 smallcnn 32 8192 "loader: dataloader, num_workers: 2, pin_memory: true" \
    "max_steps: 40, batch_size: 128, grad_accum_steps: 2, grad_clip: 1.0, precision: fp16, \
channels_last: false" "" "$nproc") || return 1
  sed -i "s|model: {name: smallcnn}|model: {name: 'planted:build', code_dir: '$out/code'}|" "$c"
  echo "ranks: $nproc"
  timeout 150 $py -m ddpflow launch -c "$c" --stage s --halt-after-steps 20; [ $? -eq 75 ] || return 1
  timeout 150 $py -m ddpflow launch -c "$c" --stage s 2>&1 | tee "$out/fp16-resume.txt"
  grep -q "resumed from" "$out/fp16-resume.txt" && holds "$(summary fp16)" \
    "s['finished'] and s['steps'] == 40 and s['skipped_steps'] == 4 and \
math.isfinite(s['final_train_loss'])"
}
ranks_run() {  # backend: bench/gpu_ranks.py once on 2 ranks; its RESULT lines in the log
  GPU_RANKS_BACKEND=$1 GPU_RANKS_DEVICE=cuda timeout 400 $py -m torch.distributed.run \
    --standalone --nproc-per-node=2 "$here/gpu_ranks.py" >"$out/ranks-$1.log" 2>&1
}
ranks_part() {  # backend part: that part's RESULT line; 77 when it said SKIP
  local line; line=$(grep "^RESULT $2 " "$out/ranks-$1.log" | tail -1)
  echo "figure: ${line#RESULT "$2" }"
  [ -n "$line" ] || { echo "figure: no RESULT line (run died; see ranks-$1.log)"; return 1; }
  case $line in "RESULT $2 PASS"*) return 0 ;; "RESULT $2 SKIP"*) return 77 ;; esac
  return 1
}
ranks() {  # backend: the 2-rank run, then one check line per part
  if [ "${GPU_DEADLINE_S:-0}" -gt 0 ] && [ $SECONDS -ge "${GPU_DEADLINE_S}" ]; then
    notrun+=("ranks_*_$1"); echo "NOT RUN ranks_*_$1 (past GPU_DEADLINE_S=$GPU_DEADLINE_S)"
    return; fi
  ranks_run "$1"
  local part
  for part in collectives ddp_no_sync grad_hook fp16_skipped syncbn compile_ddp; do
    check "ranks_${part}_$1" ranks_part "$1" "$part"
  done
}
c_export_cuda() {  # a stage's export runs model.ts on the GPU; a device-baking trace fails
  local c; c=$(cfg exp smallcnn 32 2048 "loader: device" \
    "max_steps: 5, batch_size: 64, precision: fp32") || return 1
  timeout 120 $py -m ddpflow launch -c "$c" --stage s || return 1
  timeout 120 $py -m ddpflow export -c "$c" || return 1
  $py - "$out/results/exp/export/model.json" <<'PY' || return 1
import json, sys
ts = json.load(open(sys.argv[1]))["checks"]["torchscript"]
print("figure: torchscript", ts)
sys.exit(0 if ts["ok"] and ts["checked_on"] == ["cpu", "cuda"] else 1)
PY
  $py - "$out/bake.ts" <<'PY'
import sys
from pathlib import Path

import torch
from torch import nn

from ddpflow.inference import export


class MakesATensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.mean((2, 3))) + torch.ones(2)  # traced: a CPU constant


m, x = MakesATensor().eval(), torch.randn(4, 3, 8, 8)
with torch.no_grad():
    ref = m(x)
c = export._write_format("torchscript", m, x, ref, Path(sys.argv[1]))
print("figure: device-baking trace:", c.get("error") or "passed (expected a failure)")
assert not c["ok"] and "cuda" in c["error"], c
PY
}
c_layout() {  # channels_last: auto on the GPU: a probe at the stage's batch, .view kept NCHW
  mkdir -p "$out/code"
  cat >"$out/code/viewnet.py" <<'PY'
from torch import nn


def build(num_classes, in_channels):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, 8, 3, padding=1)
            self.fc = nn.Linear(8 * 32 * 32, num_classes)

        def forward(self, x):
            h = self.conv(x)
            return self.fc(h.view(h.shape[0], -1))  # raises on a channels_last map
    return Net()
PY
  local c; c=$(cfg lay smallcnn 32 2048 "loader: device" \
    "max_steps: 5, batch_size: 96, precision: bf16, channels_last: auto") || return 1
  sed -i "s|model: {name: smallcnn}|model: {name: 'viewnet:build', code_dir: '$out/code'}|" "$c"
  XDG_CACHE_HOME=$out/cache timeout 120 $py -m ddpflow launch -c "$c" --stage s || return 1
  $py - "$(summary lay)" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print("figure:", s["channels_last"], s["layout_reason"])
sys.exit(0 if s["channels_last"] is False and "fails in channels_last" in s["layout_reason"]
         and "GPU" in s["layout_reason"] and "at batch 96" in s["layout_reason"] else 1)
PY
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
  same_weights "${f[@]}" | sed 's/^/figure: /'; return "${PIPESTATUS[0]}"
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
  timeout 120 $py -m ddpflow launch -c "$c" --stage s || return 1
  echo "figure: tuned $($py -c "import json, sys; print(json.load(open(sys.argv[1]))['choice'])" \
    "$out/results/tune/tune.json")"
}
c_nondet() {  # an op with no deterministic CUDA kernel: one message naming it, exit 2
  mkdir -p "$out/code"
  cat >"$out/code/nondet_model.py" <<'PY'
import torch
from torch import nn
from torch.nn import functional as F

# ops that torch.use_deterministic_algorithms lists among those that raise on CUDA (in their
# backward); torch 2.11 trained through bilinear interpolate's backward (H200 run, exit 0), so
# the check takes the first of these that raises on this torch (NONDET_OP)
OPS = {
    "adaptive_max_pool2d": lambda h: F.adaptive_max_pool2d(h, 5),
    "interpolate_bilinear": lambda h: F.interpolate(h, scale_factor=2, mode="bilinear",
                                                    align_corners=False),
    "reflection_pad2d": lambda h: F.pad(h, (2, 2, 2, 2), mode="reflect"),
    "grid_sample": lambda h: F.grid_sample(h, torch.zeros(h.shape[0], 4, 4, 2, device=h.device),
                                           align_corners=False),
}
NONDET_OP = "adaptive_max_pool2d"


def raises(name):  # True if this op's CUDA backward refuses deterministic mode
    torch.use_deterministic_algorithms(True)
    try:
        x = torch.randn(2, 8, 9, 9, device="cuda", requires_grad=True)
        OPS[name](x).sum().backward()
        return False
    except RuntimeError as e:
        return "deterministic" in str(e)
    finally:
        torch.use_deterministic_algorithms(False)


def build(num_classes, in_channels):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, 8, 3)
            self.fc = nn.Linear(8, num_classes)

        def forward(self, x):
            return self.fc(OPS[NONDET_OP](self.conv(x)).mean((2, 3)))
    return Net()


if __name__ == "__main__":
    print(next((name for name in OPS if raises(name)), ""))
PY
  local op; op=$(cd "$out/code" && $py nondet_model.py)
  [ -n "$op" ] || { echo "figure: no listed op raises in deterministic mode on this torch"; return 77; }
  sed -i "s/^NONDET_OP = .*/NONDET_OP = \"$op\"/" "$out/code/nondet_model.py"
  local c; c=$(cfg nondet smallcnn 32 2048 "loader: device" \
    "max_steps: 5, batch_size: 64, precision: fp32" "deterministic: true") || return 1
  sed -i "s|model: {name: smallcnn}|model: {name: 'nondet_model:build', code_dir: '$out/code'}|" "$c"
  timeout 120 $py -m ddpflow launch -c "$c" --stage s 2>"$out/nondet.err"; local rc=$?
  cat "$out/nondet.err"; echo "figure: $op: exit $rc: $(head -c 200 "$out/nondet.err")"
  [ $rc -eq 2 ] && grep -q "deterministic" "$out/nondet.err" && ! grep -q "Traceback" "$out/nondet.err"
}
c_fsdp() {  # FSDP2 + checkpointing on NCCL, halted and resumed; its memory against DDP's
  local c d
  c=$(cfg fsdp vit_b_16 224 2048 "loader: device" "max_steps: 40, batch_size: 32, \
precision: bf16, strategy: fsdp, activation_checkpointing: true" "" "$nproc") || return 1
  sed -i 's/every_steps: 0,/every_steps: 10,/' "$c"
  timeout 250 $py -m ddpflow launch -c "$c" --stage s --halt-after-steps 20; [ $? -eq 75 ] || return 1
  timeout 250 $py -m ddpflow launch -c "$c" --stage s 2>&1 | tee "$out/fsdp-resume.txt"
  grep -q "resumed from ckpt-000000020.dcp" "$out/fsdp-resume.txt" || return 1
  d=$(cfg fsdpddp vit_b_16 224 2048 "loader: device" "max_steps: 40, batch_size: 32, \
precision: bf16" "" "$nproc") || return 1
  timeout 250 $py -m ddpflow launch -c "$d" --stage s || return 1
  $py - "$(summary fsdp)" "$(summary fsdpddp)" <<'PY'
import json, sys
f, d = (json.load(open(p)) for p in sys.argv[1:3])
fm, dm = (max(m["peak_mib"] for m in s["memory_per_rank"]) for s in (f, d))
print("figure:", {"world": f["world_size"], "backend": f["backend"], "fsdp_peak_mib": fm,
                  "ddp_peak_mib": dm, "peak_ratio": round(fm / dm, 2),
                  "fsdp_samples_per_s": f["mean_samples_per_s"],
                  "ddp_samples_per_s": d["mean_samples_per_s"]})
ok = (f["finished"] and f["backend"] == "nccl" and f["sharding"]
      and f["checkpointed_blocks"] == 12)
sys.exit(0 if ok and (f["world_size"] < 2 or fm <= 0.6 * dm) else 1)
PY
}
c_flight() {  # NCCL's flight recorder dumps on a collective's timeout, the report names it
  timeout 120 $py -m torch.distributed.run --standalone --nproc-per-node 1 \
    "$here/gpu_flight.py" "$out/flight"; echo "the stuck run ended: exit $?"
  $py "$here/gpu_flight.py" "$out/flight" --read
}
c_sampling() {  # balanced draws + a policy on the device loader: a resumed stage, bit-exact
  local f=() run c
  for run in sb1 sb2; do
    c=$(cfg "$run" smallcnn 32 4096 "loader: device, sampling: balanced, \
augment: {policy: trivialaugment}" "max_steps: 30, batch_size: 128, precision: bf16" \
      "deterministic: true") || return 1
    if [ $run = sb2 ]; then
      timeout 120 $py -m ddpflow launch -c "$c" --stage s --halt-after-steps 15
      [ $? -eq 75 ] || return 1
    fi
    timeout 120 $py -m ddpflow launch -c "$c" --stage s 2>&1 | tee "$out/$run.txt" || return 1
    f+=("$out/results/$run/stages/s/final.pt")
  done
  grep -q "resumed from" "$out/sb2.txt" || return 1
  holds "$(summary sb1)" "s['finished'] and s['loader'] == 'device'" || return 1
  echo "straight through, halted at 15 and resumed:"
  same_weights "${f[@]}" | sed 's/^/figure: /'; return "${PIPESTATUS[0]}"
}
figures() {  # channels_last against not, and a small-image model
  local c
  c=$(cfg rn50nchw resnet50 224 4096 "loader: device" \
    "max_steps: 80, batch_size: 256, precision: bf16, channels_last: false") &&
    timeout 200 $py -m ddpflow launch -c "$c" --stage s
  c=$(cfg rn18 resnet18 32 16384 "loader: device" \
    "max_steps: 200, batch_size: 512, precision: bf16, channels_last: true") &&
    timeout 120 $py -m ddpflow launch -c "$c" --stage s
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "== $gpus GPU(s); ddpflow's own runs use $nproc rank(s)"
# the most telling first: a lease can end before the last
check env c_env
check flight_recorder c_flight
check sampling_resume c_sampling
check rn50_bf16 c_rn50
check fp16_resume c_fp16
check determinism c_det
check fsdp c_fsdp
check nondeterministic c_nondet
check layout_probe c_layout
check export_cuda c_export_cuda
check doctor c_doctor
check compile c_compile
check tune c_tune
ranks gloo
if [ "$gpus" -ge 2 ]; then ranks nccl
else skipped+=("ranks_*_nccl: NCCL on 2 ranks needs 2 GPUs (NCCL refuses 2 ranks on one GPU)"
              "fp16_resume on 2 ranks: ddpflow binds a rank per GPU; it ran on 1 rank (no DDP)")
fi
if [ "${GPU_DEADLINE_S:-0}" -gt 0 ] && [ $SECONDS -ge "${GPU_DEADLINE_S}" ]; then
  notrun+=(figures)
else figures >"$out/figures.log" 2>&1 || echo "(a figure run failed: $out/figures.log)"; fi
for s in "${skipped[@]}"; do echo "NOT EXERCISED $s"; done
echo "== $fails check(s) failed, ${#skipped[@]} not exercised, ${#notrun[@]} not run" \
  "(${notrun[*]:-}); logs in $out"
echo "== table for docs/BENCHMARKS.md ($(git rev-parse --short HEAD 2>/dev/null), $(cat "$out/gpu.txt"))"
$py "$here/gpu_table.py" "$out"/results/*/stages/s/summary.json | tee "$out/table.md"
archive
exit "$fails"
