#!/usr/bin/env bash
# One-GPU check of the vLLM path (see scripts/gpu_check.py): bash scripts/gpu_check.sh --out results/gpu_check.json
cd "$(dirname "$0")/.." && exec torchrun --standalone --nproc_per_node "${NPROC:-1}" scripts/gpu_check.py "$@"
