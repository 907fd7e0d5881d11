#!/usr/bin/env bash
# One command that exercises the GPU path and writes down what it measured (issue 34, item 2):
# SGLang rollouts and log-prob recompute, weight reloads into the server, the update with the local
# strategy then DeepSpeed (one rank, NCCL), for two iterations; report.json + report.md under --out
# (default workspace/gpu-check/). The driver is benchmarks/gpu_check.py; `--help` lists the options.
#
#   scripts/gpu_check.sh                         # on a CUDA machine: builds .venv-sglang, starts SGLang
#   scripts/gpu_check.sh --checkpoint /m/Qwen3-4B rollout.max_turn_tokens=2048 rollout.max_response_tokens=8192
#   scripts/gpu_check.sh --url http://127.0.0.1:30000   # an SGLang server already running here
#   scripts/gpu_check.sh --double                # a CPU machine: the same logic against the contract double
#
# Every server it starts listens on 127.0.0.1 and dies with it (stopped by pid, PR_SET_PDEATHSIG if killed).
set -euo pipefail
cd "$(dirname "$0")/.."

# SGLang pins its own torch (0.5.23: torch 2.14.1 with CUDA 13 wheels, transformers 5.19.0), which cannot
# share .venv (torch 2.13.0, transformers 5.15.0): it gets a venv of its own beside the project's,
# .venv-sglang, built on first use. 0.5.23 is the release whose /generate, /update_weights_from_disk,
# /model_info and launch flags (--mem-fraction-static, --host) the driver was written against.
export SGLANG_VERSION=0.5.23

if [ ! -x .venv/bin/python ]; then
  echo "gpu_check: .venv is missing: run 'make setup' (scripts/setup.sh) first" >&2
  exit 2
fi
export PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
# exec: the driver is this script's process, so a signal sent to the script reaches it (and its servers)
exec .venv/bin/python -m benchmarks.gpu_check "$@"
