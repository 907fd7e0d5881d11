#!/usr/bin/env bash
# Build .venv from nothing, idempotently. The order matters (docs/install.md):
# the CPU torch first, then flash-attn/deepspeed as pure-Python builds, then openrlhf, then us.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.cleaner-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ]; then
  exit 0
fi
echo "[setup] building $VENV (a few minutes the first time)"
[ -x $VENV/bin/python ] || $PY -m venv $VENV
# The machine's pip config lists local indexes that do not hold every package: hide that noise.
pip_install() {
  local log rc=0
  log=$(mktemp)
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || rc=$?
  grep -v -e "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return $rc
}
PIP=pip_install
$PIP --upgrade pip setuptools wheel packaging psutil ninja
# A bare `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
$PIP torch==2.13.0
if ! $VENV/bin/python -m pip show -q flash-attn >/dev/null 2>&1; then
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    $PIP flash-attn==2.8.3 --no-build-isolation --no-deps
fi
if ! $VENV/bin/python -m pip show -q deepspeed >/dev/null 2>&1; then
  DS_BUILD_OPS=0 $PIP deepspeed==0.19.6 --no-build-isolation
fi
$PIP -e ".[dev]"
# triton's log-prob kernels would shadow OpenRLHF's torch fallback on CPU.
$VENV/bin/python -m pip uninstall -y -q triton 2>/dev/null || true
# train.strategy=deepspeed on CPU: DeepSpeed JIT-builds its shared-memory collective op on first use;
# build it now (cached under ~/.cache/torch_extensions) so no training run or test pays for it.
if $VENV/bin/python -c "import sys, torch; sys.exit(1 if torch.cuda.is_available() else 0)" 2>/dev/null; then
  DS_ACCELERATOR=cpu $VENV/bin/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()" \
    >/dev/null 2>&1 || echo "[setup] note: DeepSpeed's CPU comm op did not build; strategy=deepspeed will retry at run time"
fi
# PYTHONDONTWRITEBYTECODE=1 is set on these machines: compile once so imports stay fast.
$VENV/bin/python -m compileall -q -j 0 $VENV/lib >/dev/null 2>&1 || true
rm -f $VENV/.cleaner-setup-*
touch "$STAMP"
echo "[setup] done"
