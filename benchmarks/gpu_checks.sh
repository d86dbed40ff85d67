#!/usr/bin/env bash
# The GPU measurements behind docs/how-to/gpu.md in one command, on a machine with one GPU where fedlora imports
# (about 9 minutes on an H100 or H200), most needed first: client training against client-batch beside the path
# before (benchmarks.client_throughput), the same at precision bf16-backbone, where a group of 16 clients spends its
# time and the model alone at both precisions (--profile), a round of configs/cifar100_private.toml's offline twin in
# process (benchmarks.preset_round, 64 clients at a time) at both precisions, the same round through `fedlora run` on
# Ray with the preset's own resources, and the timm family's rows.
#
#     bash benchmarks/gpu_checks.sh [DIR]     # DIR: also copy the results and a log there
#
# The throughput rows and the profile land in benchmarks/results/, the Ray round's run in runs/gpu-ray-round, and
# preset_round's output (it writes no file) in the log. The results are copied to DIR after every step, so that a
# run stopped by a time limit keeps what had finished.
set -uo pipefail
out=${1:+$(realpath -m "$1")}
cd "$(dirname "$0")/.."
[ -n "$out" ] && mkdir -p "$out"
log=${out:+$out/gpu_checks.log}
log=${log:-runs/gpu_checks.log}
mkdir -p runs
: > "$log"
export PYTHONUNBUFFERED=1
twin=(dataset=\"synthetic\" model=\"vit-b16-random\" train-examples=50000 test-examples=2000)
vit=(--preset cifar100_private --model vit-b16-random)
status=0
save() {  # what has finished so far, to DIR
  [ -n "$out" ] || return 0
  cp benchmarks/results/client_throughput.json benchmarks/results/client_throughput.md "$out"/ 2>/dev/null
  cp benchmarks/results/client_profile_*_m16*.md "$out"/ 2>/dev/null
  cp runs/gpu-ray-round/metrics.jsonl "$out"/ray_round_metrics.jsonl 2>/dev/null
  return 0
}
step() {  # one measurement: its command and output in the log; a failure is reported and the others still run
  echo "== $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== failed with exit code $rc: $*" | tee -a "$log"; status=1; }
  save
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
step python3 -m benchmarks.client_throughput "${vit[@]}" --baseline --batches 1,4,16,64 --clients 64
step python3 -m benchmarks.client_throughput "${vit[@]}" --precision bf16-backbone --batches 16,64 --clients 64
step python3 -m benchmarks.client_throughput "${vit[@]}" --profile 16
step python3 -m benchmarks.preset_round --set client-batch=64
step python3 -m benchmarks.preset_round --set client-batch=64 precision=\"bf16-backbone\"
rm -rf runs/gpu-ray-round
step python3 -m fedlora.cli run --config cifar100_private --set "${twin[@]}" num-rounds=1 eval-every=1 \
  --out runs/gpu-ray-round
step python3 -m benchmarks.client_throughput --preset cifar100_private --model timm-vit-b16-random \
  --batches 16,64 --clients 64
echo "== done ($(date -u +%H:%M:%S)), exit $status" | tee -a "$log"
exit $status
