#!/usr/bin/env bash
# The GPU check of train.py's real step (scripts/gpu_check.py launches torchrun itself):
#   bash scripts/gpu_check.sh --out results/gpu_check.json [--size 1.5b] [--engine vllm] [--nproc 8]
cd "$(dirname "$0")/.." && exec python scripts/gpu_check.py "$@"
