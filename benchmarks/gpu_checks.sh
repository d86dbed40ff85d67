#!/usr/bin/env bash
# The GPU measurements behind docs/how-to/gpu.md in one command, on a machine with one GPU where fedlora imports
# (about 9 minutes on an H200: 528 s at 41d2e4d), in this order: three rounds of configs/cifar100_private.toml's offline
# twin in process (benchmarks.preset_round: the rounds after the first are what 50 rounds cost) at the default
# client-batch and at 64, the same three rounds through `fedlora run` on Ray with the preset's own resources, client
# training against client-batch beside the path before (benchmarks.client_throughput), and where a group of 16
# clients spends its time with the model alone at both bf16 precisions (--profile). The rows at bf16 autocast alone
# and timm's were measured on an H200 at fe55199 (benchmarks/results/client_throughput.md); the eight Ray rounds of
# benchmarks/results/preset_round_gpu.md are `fedlora run` with num-rounds=8 eval-every=4, in a call of their own.
#
#     bash benchmarks/gpu_checks.sh [DIR]     # DIR: also copy the results and a log there
#
# The throughput rows and the profile land in benchmarks/results/, the Ray rounds' run in runs/gpu-ray-rounds, and
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
  cp runs/gpu-ray-rounds/metrics.jsonl "$out"/ray_rounds_metrics.jsonl 2>/dev/null
  tail -n 40 runs/gpu-ray-rounds/superlink.log runs/gpu-ray-rounds/flower.log > "$out"/ray_rounds_logs.txt 2>/dev/null
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
step python3 -m benchmarks.preset_round --rounds 3
step python3 -m benchmarks.preset_round --rounds 3 --set client-batch=64
rm -rf runs/gpu-ray-rounds
step python3 -m fedlora.cli run --config cifar100_private --set "${twin[@]}" num-rounds=3 eval-every=3 \
  --out runs/gpu-ray-rounds
step python3 -m benchmarks.client_throughput "${vit[@]}" --baseline --batches 16,64 --clients 64
step python3 -m benchmarks.client_throughput "${vit[@]}" --profile 16
echo "== done ($(date -u +%H:%M:%S)), exit $status" | tee -a "$log"
exit $status
