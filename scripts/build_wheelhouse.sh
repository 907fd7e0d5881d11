#!/usr/bin/env bash
# The wheelhouse the GPU check installs on an air-gapped CUDA machine (docs/gpu.md): what that machine's Python
# 3.12 + CUDA torch + transformers lack for the check, ≈ 10 MiB. Run it on a connected machine (any OS Python with
# pip; the two source builds use .venv's CPU torch to run their setup.py); carry build/wheelhouse to the GPU
# machine beside the working tree, where scripts/gpu_check.sh installs it with `pip install --no-index --no-deps`.
#
#   scripts/build_wheelhouse.sh [OUT]      # default build/wheelhouse (git-ignored)
#
# Binary wheels are downloaded for CPython 3.12 on manylinux2014 x86-64 whatever this machine runs; deepspeed and
# flash-attn publish only sdists, built here as pure-Python wheels (no CUDA kernel: DeepSpeed's ops are not
# prebuilt, and cleaner uses none of them; flash-attn's Python package is imported by OpenRLHF, its kernels only
# with train.attn_implementation=flash_attention_2, which refuses where they are absent). Versions are .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/wheelhouse}"
PY="${PYTHON:-python3}"
BUILD_PY=.venv/bin/python  # has torch (flash-attn's setup.py imports it) and setuptools
if [ ! -x "$BUILD_PY" ]; then
  echo "build_wheelhouse: .venv is missing: run 'make setup' first (its torch runs flash-attn's setup.py)" >&2
  exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT"
pip_q() { "$@" --disable-pip-version-check --quiet; }

# pydantic and its four, rapidfuzz, json-repair, hjson, pylatexenc, openrlhf (--no-deps: of its requirements only
# those below are imported by openrlhf.models and openrlhf.utils.deepspeed: peft, accelerate and einops by its
# Actor, torchdata by its strategy; py-cpuinfo and msgpack by DeepSpeed; found by running the check with Python
# 3.12 and nothing but torch, transformers and these). rapidfuzz 3.13.0: the newest with a cp312 manylinux wheel
# on the package index this project's machines reach (.venv's 3.14.6 has none there; pyproject asks >= 3.9).
pip_q "$PY" -m pip download --no-deps --dest "$OUT" --python-version 3.12 --implementation cp --abi cp312 \
  --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  rapidfuzz==3.13.0 json-repair==0.64.6 hjson==3.1.0 openrlhf==0.11.2 \
  peft==0.21.2 accelerate==1.15.0 einops==0.8.2 torchdata==0.11.0 py-cpuinfo==9.0.0 msgpack==1.2.4
# pylatexenc 2.11 publishes an sdist only: a pure wheel
pip_q "$BUILD_PY" -m pip wheel --no-deps --wheel-dir "$OUT" pylatexenc==2.11
# DeepSpeed without any prebuilt op: a pure wheel (cleaner pins torch's AdamW through DeepSpeed's torch_adam)
DS_BUILD_OPS=0 pip_q "$BUILD_PY" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$OUT" deepspeed==0.19.6
# flash-attn's Python package without its CUDA extension, built here rather than fetched from its releases
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  pip_q "$BUILD_PY" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$OUT" flash-attn==2.8.3

for w in "$OUT"/*.whl; do
  case "$(basename "$w")" in
    *-py3-none-any.whl|*-py2.py3-none-any.whl|*cp312*manylinux*x86_64*.whl) ;;
    *) echo "build_wheelhouse: $(basename "$w") will not install on CPython 3.12 x86-64" >&2; exit 1 ;;
  esac
done
echo "build_wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
