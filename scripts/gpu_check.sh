#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; docs/gpu.md). On an air-gapped CUDA machine it runs with that machine's
# own Python, CUDA torch and transformers; the few packages they lack come from build/wheelhouse
# (scripts/build_wheelhouse.sh, run on a connected machine; CLEANER_WHEELHOUSE=DIR for another folder), installed
# once into workspace/gpu-check/site (CLEANER_GPU_SITE) with `pip install --no-index --no-deps --target` and put on
# PYTHONPATH. Nothing is downloaded.
#
#   scripts/gpu_check.sh                          # the GPU: Qwen3-0.6B and -4B shapes, 8k-token trajectories
#   scripts/gpu_check.sh --device cpu --tokens 256   # the same logic on the CPU, tiny shapes (the test suite's)
#   PYTHON=/opt/py312/bin/python scripts/gpu_check.sh  # which Python (default: python3 on PATH)
#   scripts/gpu_check.sh --sglang [--double] ...  # the SGLang path, for a connected machine (builds .venv-sglang)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--sglang" ]; then
  shift
  # SGLang pins its own torch (0.5.23: torch 2.14.1 with CUDA 13 wheels, transformers 5.19.0), which cannot
  # share .venv: it gets a venv of its own beside the project's, .venv-sglang, built on first use.
  export SGLANG_VERSION=0.5.23
  if [ ! -x .venv/bin/python ]; then
    echo "gpu_check: .venv is missing: run 'make setup' (scripts/setup.sh) first" >&2
    exit 2
  fi
  export PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
  # exec: the driver is this script's process, so a signal sent to the script reaches it (and its servers)
  exec .venv/bin/python -m benchmarks.gpu_check_sglang "$@"
fi

PY="${PYTHON:-python3}"
SITE="${CLEANER_GPU_SITE:-workspace/gpu-check/site}"
export PYTHONPATH="$PWD"
# The wheelhouse: CLEANER_WHEELHOUSE when set, else build/wheelhouse when this Python lacks what it holds
WHEELS="${CLEANER_WHEELHOUSE:-}"
if [ -z "$WHEELS" ] && compgen -G "build/wheelhouse/*.whl" >/dev/null \
    && ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
          ('pydantic', 'rapidfuzz', 'json_repair', 'peft', 'openrlhf', 'deepspeed', 'flash_attn')))" 2>/dev/null; then
  WHEELS=build/wheelhouse
fi
if [ -n "$WHEELS" ]; then
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu_check: no wheels in $WHEELS (scripts/build_wheelhouse.sh builds them on a connected machine)" >&2
    exit 2
  fi
  mkdir -p "$SITE" && SITE="$(cd "$SITE" && pwd)"
  stamp="$(ls -l "$WHEELS"/*.whl | md5sum | cut -d' ' -f1)"
  if [ "$(cat "$SITE/.wheelhouse" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE"
    if ! "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" \
        "$WHEELS"/*.whl; then
      echo "gpu_check: the wheels in $WHEELS do not install with $PY ($("$PY" -V 2>&1)); scripts/build_wheelhouse.sh" \
           "builds them for CPython 3.12 on x86-64" >&2
      exit 2
    fi
    rm -rf "$SITE/tests"  # openrlhf's wheel installs a top-level `tests` package that would shadow the project's
    echo "$stamp" > "$SITE/.wheelhouse"
  fi
  export PYTHONPATH="$PWD:$SITE"
fi
export TOKENIZERS_PARALLELISM=false
exec "$PY" -m benchmarks.gpu_check "$@"
