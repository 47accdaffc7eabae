#!/usr/bin/env bash
# The GPU check, for whoever has a CUDA GPU at hand:  bash benchmarks/gpu_check.sh
#
# About 6 minutes on one H100 (the first five steps measured 2026-11-26, about 4 minutes together; the
# new ones estimated). Runs, each step even when an earlier one failed:
#   1. every CUDA test (tests/test_cuda.py; NCCL tests of 2+ ranks when 2+ GPUs are visible) under
#      torch's CUDA sanitizer, which checks every kernel's accesses against the streams and events
#      ordering them;
#   1b. tests/test_exact_cuda.py: exact reduction's assumptions about the CUDA kernels (AdamW's foreach
#      and fused kernels give an element the same bits wherever it sits in a row) and, with 2+ GPUs,
#      the same bits at W = 1 and 2 over NCCL (never run yet);
#   2. benchmarks/gpu_single.py: one GPU, bf16, ZeRO stage 2 against the plain Trainer (fused AdamW);
#   3. benchmarks/gpu_overlap.py: GPT-2 1.2B as rank 0 of 2, the second rank emulated, over links of
#      100 to 12.5 GB/s: the reduce-scatter and all-gather time hidden, host syncs per phase, the step
#      against W=1 (needs ZeroConfig.overlap_allgather);
#   3b. benchmarks/gpu_plan_time.py: the plan's predicted step time (issue 56's time model, for this GPU)
#      against the measured steps of 2 and 3 (the Trainer rows of gpu_single, every link of gpu_overlap
#      with the all-gather overlapped, its W=1): within 15% each; results/gpu_plan_time.{md,json};
#   4. benchmarks/gpu_trainer_offload.py: the Trainer with optimizer offload, its losses against the
#      run without;
#   5. ray_jobs/finetune.py --use-gpu --num-workers 1, the main job on the GPU (skipped, not failed,
#      where Ray is not installed: the lent machines have none and no internet);
#   6. benchmarks/gpu_plan.py: the memory plan against torch.cuda.max_memory_allocated, three setups;
#   7. benchmarks/gpu_snapshot.py: a memory snapshot's side-stream copy against the step it overlaps;
#   8. the GPU half of benchmarks/offload.py: with offload, each part of a step (the norm's wait,
#      widening 16-bit rows, the host AdamW, the copies back) with our host kernel and with torch's;
#   9. benchmarks/offload_host.py on the machine's host cores: the offloaded step's host time, with our
#      host kernel and with torch's, against torch's fused CPU AdamW alone, our kernel alone and
#      DeepSpeedCPUAdam (where it is installed), 32M rows;
#  10. benchmarks/offload.py --deepspeed: DeepSpeed ZeRO-2 with its optimizer offload on the same models
#      (where DeepSpeed is installed; its CPUAdam op builds on first use).
# Results land in benchmarks/results/gpu_* (commit them); the exit status is 1 if any step failed.
# Each step has a time limit (seconds, second argument of `step` below), so one that hangs (a stuck
# NCCL collective, say) fails on its own and the others still run; and no step runs past BUDGET
# seconds from the start (its limit shrinks; one with too little time left is skipped and counts as
# failed), so the whole check stays within a lent machine's 10 minutes.
# Needs torch, transformers, safetensors and pytest (Ray optional); installs this checkout without its deps.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! command -v python >/dev/null; then  # some images have python3 alone (a wrapper, not a link: a
    shim=$(mktemp -d)                    # link to a venv's python3 would lose the venv's packages)
    printf '#!/bin/sh\nexec %q "$@"\n' "$(command -v python3)" >"$shim/python"
    chmod +x "$shim/python"
    export PATH="$shim:$PATH"
fi
failed=()
BUDGET=570  # seconds for all the steps: 10 minutes less the machine's report and the last step's grace

step() {  # step NAME SECONDS COMMAND...: run it (killed after SECONDS), keep its output in $RESULTS/gpu_NAME.log, remember a failure
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 10))  # 10: timeout's grace between its TERM and its KILL
    if ((left < 20)); then
        echo "=== $name: SKIPPED, $((BUDGET - SECONDS)) s left of the check's $BUDGET s: $*" | tee "$RESULTS/gpu_$name.log"
        failed+=("$name")
        return
    fi
    ((left < limit)) && limit=$left
    echo "=== $name (at most $limit s): $*"
    local start=$SECONDS
    if timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/gpu_$name.log"; then
        echo "=== $name: ok in $((SECONDS - start)) s"
    else
        echo "=== $name: FAILED in $((SECONDS - start)) s"
        failed+=("$name")
    fi
}

python - <<'EOF' | tee "$RESULTS/gpu_machine.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s):",
      ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none")
EOF
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "no CUDA GPU is visible: nothing to check here"
    exit 1
}

# Measured on one H100: tests 43 s, single 50, plan 29, snapshot 27, offload 64 to 95. Estimated:
# exact 20 to 40, plan_time 30 to 60, overlap 60 to 110 (4 rounds of 33 blocks of 4 steps of 80 to 300 ms, about 60 s, and
# 20 s to build and probe), trainer_offload 20 to 40, ray 60 to 90 where Ray is installed (2 where not).
step tests 120 env TORCH_CUDA_SANITIZER=1 python -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda.py
step exact 60 python -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_exact_cuda.py
step single 120 python benchmarks/gpu_single.py
step overlap 180 python benchmarks/gpu_overlap.py
step plan_time 90 python benchmarks/gpu_plan_time.py  # estimated 30 to 60 s: four simulated steps, no GPU work
step trainer_offload 90 python benchmarks/gpu_trainer_offload.py
if python -c "import ray" 2>/dev/null; then
    step ray 150 env RAY_USAGE_STATS_ENABLED=0 python ray_jobs/finetune.py --use-gpu --num-workers 1 \
        --storage-path "$(mktemp -d)"  # a fresh run: a rerun of the same name would resume the last one
else
    echo "=== ray: skipped: Ray is not installed here (pip install -c constraints.txt -e '.[ray]' where there is" \
        "internet, then rerun)" | tee "$RESULTS/gpu_ray.log"
fi
step plan 60 python benchmarks/gpu_plan.py
step snapshot 60 python benchmarks/gpu_snapshot.py
step offload 240 python benchmarks/offload.py --gpu-only
step offload_host 120 python benchmarks/offload_host.py --numel 32e6 --rounds 3 --name gpu_offload_host
if python -c "import deepspeed" 2>/dev/null; then
    step offload_deepspeed 120 python benchmarks/offload.py --deepspeed
else
    echo "=== offload_deepspeed: skipped: DeepSpeed is not installed here" | tee "$RESULTS/gpu_offload_deepspeed.log"
fi

if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed; results in $RESULTS/gpu_*"
