#!/usr/bin/env bash
# The browser the viewer's tests drive (tests/test_viewer.py): Debian's headless Chromium and its matching
# chromedriver, driven through Selenium pinned below, so nothing is downloaded at test time (Selenium is given
# /usr/bin/chromedriver and SE_OFFLINE=true: its manager never looks for a browser online). Idempotent: installs
# only what is missing. As root (like the rest of set-up), or with sudo available.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
SELENIUM=selenium==4.51.0  # 4.52 needs a certifi newer than the package index carries here
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "[browser] installing Debian's chromium and chromium-driver"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('selenium') != '${SELENIUM#*==}')" \
    2>/dev/null; then
  echo "[browser] installing $SELENIUM into $VENV"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$SELENIUM"
fi
/usr/bin/chromedriver --version >/dev/null
