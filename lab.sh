#!/usr/bin/env bash
# ./lab.sh            set up (once) and open JupyterLab on labs/
# ./lab.sh test [..]  set up (once) and run every test; extra arguments go to pytest
# ./lab.sh doctor     set up (once) and check the installation
# ./lab.sh bench [..] set up (once) and measure every performance claim (python -m lablib.bench --help)
#
# Set-up: a virtual environment in .venv with this package and its test tools, reinstalled when
# pyproject.toml changes. PYTHON picks the interpreter (>= 3.10). TORCH_INDEX_URL installs torch
# from another index first, e.g. https://download.pytorch.org/whl/cpu for the small CPU-only build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "lab.sh: Python 3.10 or newer is needed; '$PYTHON' is $("$PYTHON" --version 2>&1 || echo missing)." >&2
    echo "        Install one, then run: PYTHON=python3.11 ./lab.sh" >&2
    exit 1
  fi
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.lablib-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ -n "${TORCH_INDEX_URL:-}" ] && ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    "$VENV/bin/python" -m pip install torch --index-url "$TORCH_INDEX_URL"
  fi
  "$VENV/bin/python" -m pip install -e ".[test]"
  touch "$stamp"
fi

command="${1:-lab}"
[ $# -gt 0 ] && shift
case "$command" in
  lab)    exec "$VENV/bin/jupyter" lab labs/ "$@" ;;
  test)   "$VENV/bin/lablib" quiz check && exec "$VENV/bin/python" -m pytest "$@" ;;
  doctor) exec "$VENV/bin/lablib" doctor "$@" ;;
  bench)  exec "$VENV/bin/python" -m lablib.bench "$@" ;;
  *) echo "usage: ./lab.sh [lab | test [pytest args] | doctor | bench [--quick]]" >&2; exit 2 ;;
esac
