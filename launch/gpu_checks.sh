#!/usr/bin/env bash
# The checks a lent GPU is for, in one call, each under its own limit (about 8 minutes in all on
# one H100), writing under DIR (default: $OUT where the device tool sets it, else runs/gpu-checks):
#
#   1. the kernels' PTX on this GPU's Triton (launch/kernel_ptx.py: 16-byte vector loads where
#      a block is 16-byte aligned; registers and the warps per SM they allow);
#   2. pytest -m "cuda or multigpu" (the kernels against torch's bit for bit, launches, the whole
#      phase's CUDA kernels, the sync-free fused step, CUDA graph capture; multigpu skips on one);
#   3. launch/kernel_bench.py (the kernel beside torch's recipe and one read, queued; the sweep);
#   4. launch/bench.py --device cuda, the bytes sweep up to 512 MB (the whole phase: torch's
#      recipe, distscaler with its kernels and with torch's, captured in a CUDA graph);
#   5. launch/host_cost.py at 144 tensors on this machine's CPU (the kernels stubbed: the same
#      table docs/benchmarks.md gives for a 2-core AMD EPYC), and again on the GPU with the
#      launches real (cProfile of the 144-tensor clip phase after it), so that the GPU's host
#      time per phase splits into its Python and dispatch and its launches.
#
#     bash launch/gpu_checks.sh [DIR]
#
# Each step prints its exit status and time; its output is in DIR/<step>.log. A step that fails
# does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu-checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/env.txt"

step() {  # step NAME LIMIT_S CMD...: run CMD under LIMIT_S seconds, output in $out/NAME.log
  local name=$1 limit=$2 begun=$SECONDS status=0
  shift 2
  timeout --kill-after=10s "$limit" "$@" >"$out/$name.log" 2>&1 || status=$?
  echo "== $name: exit $status in $((SECONDS - begun)) s (limit $limit s)"
}

step ptx 60 python3 launch/kernel_ptx.py
cat "$out/ptx.log"
step pytest 150 python3 -m pytest -m "cuda or multigpu" -q -p no:cacheprovider tests
grep -E "^(FAILED|ERROR) " "$out/pytest.log" | head -n 15
tail -n 1 "$out/pytest.log"
step kernel_bench 150 python3 launch/kernel_bench.py --out "$out/kernel-bench" --iters 10
grep -E "1.536e9|500 mixed|2 GB|sweep|update" "$out/kernel_bench.log" | cut -c1-300 | head -n 24
step bench 90 python3 launch/bench.py --device cuda --sweeps bytes --contenders distscaler \
  distscaler-torch-kernels distscaler-graph torch --max-params 134217728 --rounds 11 \
  --out "$out/bench"
grep -A 9 "Sweep: bytes" "$out/bench/results.md" 2>/dev/null || tail -n 5 "$out/bench.log"
step host_cost 60 python3 launch/host_cost.py --tensors 144 --rounds 5
tail -n 3 "$out/host_cost.log"
step host_cost_cuda 90 python3 launch/host_cost.py --device cuda --tensors 144 10 1000 \
  --rounds 5 --profile
grep -E "^\| [0-9]" "$out/host_cost_cuda.log"
