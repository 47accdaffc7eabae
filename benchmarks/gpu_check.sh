#!/usr/bin/env bash
# The GPU check, for whoever has a CUDA GPU at hand:  bash benchmarks/gpu_check.sh
#
# About 4 minutes on one H100 (measured 2026-11-26). Runs, each step even when an earlier one failed:
#   1. every CUDA test (tests/test_cuda.py; NCCL tests of 2+ ranks when 2+ GPUs are visible) under
#      torch's CUDA sanitizer, which checks every kernel's accesses against the streams and events
#      ordering them;
#   2. benchmarks/gpu_single.py: one GPU, bf16, ZeRO stage 2 against the plain Trainer (fused AdamW);
#   3. the GPU half of benchmarks/offload.py;
#   4. benchmarks/gpu_plan.py: the memory plan against torch.cuda.max_memory_allocated, three setups;
#   5. benchmarks/gpu_snapshot.py: a memory snapshot's side-stream copy against the step it overlaps.
# Results land in benchmarks/results/gpu_* (commit them); the exit status is 1 if any step failed.
# Each step has a time limit (seconds, second argument of `step` below), so one that hangs (a stuck
# NCCL collective, say) fails on its own and the others still run: the whole check stays within a
# lent machine's 10 minutes.
# Needs torch, transformers, safetensors and pytest (no Ray); installs this checkout without its deps.
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

step() {  # step NAME SECONDS COMMAND...: run it (killed after SECONDS), keep its output in $RESULTS/gpu_NAME.log, remember a failure
    local name=$1 limit=$2
    shift 2
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

step tests 120 env TORCH_CUDA_SANITIZER=1 python -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda.py
step single 120 python benchmarks/gpu_single.py
step offload 240 python benchmarks/offload.py --gpu-only
step plan 60 python benchmarks/gpu_plan.py
step snapshot 60 python benchmarks/gpu_snapshot.py

if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed; results in $RESULTS/gpu_*"
