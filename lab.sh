#!/usr/bin/env bash
# ./lab.sh [options]   set up (once), copy new labs to my-labs/ and open JupyterLab there; options
#                      (--no-browser, --port 8899, ...) go to `jupyter lab`
# ./lab.sh lab [..]    the same
# ./lab.sh test [..]   set up (once) and run every test; extra arguments go to pytest
# ./lab.sh doctor      set up (once) and check the installation
# ./lab.sh bench [..]  set up (once) and measure every performance claim (python -m lablib.bench --help)
# ./lab.sh --help      this text (`./lab.sh lab --help` for JupyterLab's options)
#
# Set-up: a virtual environment in .venv with this package and its test tools, reinstalled when
# pyproject.toml changes. PYTHON picks the interpreter (>= 3.10). Torch, unless .venv already has it:
# the version the suite runs on in CI (TORCH_VERSION=X.Y.Z picks another), on Linux without an NVIDIA
# driver the CPU build from https://download.pytorch.org/whl/cpu (if it answers within 5 s), else from
# pip's default index (on Linux: the CUDA build, several GB); TORCH_INDEX_URL=URL installs it from URL.
#
# Your work: labs/ holds the released notebooks, which `git pull` updates; ./lab.sh copies every one
# missing from my-labs/ (MY_LABS=DIR for another folder) and never overwrites a notebook there.
# As root (e.g. in a container) it adds --allow-root, without which JupyterLab refuses to start.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VENV=.venv
MY_LABS="${MY_LABS:-my-labs}"
# For tests (tests/test_setup.py): `source lab.sh` defines the functions below and runs nothing;
# LABSH_NVIDIA_SMI (a command), LABSH_NVIDIA_PATHS (paths whose presence means a driver) and
# LABSH_CPU_INDEX replace what the choice of torch build probes.
CPU_INDEX="${LABSH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
# The torch CI tests with (docs/clusters.md, Tested versions): what a new .venv gets, wherever it comes from.
TORCH_SPEC="torch==${TORCH_VERSION:-2.13.0}"

usage() {
  echo "usage: ./lab.sh [lab] [jupyter lab options] | test [pytest args] | doctor | bench [--quick] | --help"
}

say() { echo "lab.sh: $*" >&2; }

nvidia_driver() {  # is an NVIDIA driver installed? (WSL puts nvidia-smi in /usr/lib/wsl/lib)
  local path
  for path in ${LABSH_NVIDIA_PATHS-/proc/driver/nvidia /usr/lib/wsl/lib/nvidia-smi}; do
    [ -e "$path" ] && return 0
  done
  command -v "${LABSH_NVIDIA_SMI:-nvidia-smi}" >/dev/null 2>&1
}

answers() {  # answers PYTHON URL: does URL answer within 5 s, name lookup included?
  "$1" - "$2" 2>/dev/null <<'PY'
import os, sys, threading, urllib.request
answered = []
def probe():
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=5):
            answered.append(True)
    except Exception:
        pass
thread = threading.Thread(target=probe, daemon=True)
thread.start()
thread.join(5)
os._exit(0 if answered else 1)
PY
}

choose_torch_index() {  # choose_torch_index PYTHON: sets TORCH_INDEX (empty: pip's default) and TORCH_REASON
  TORCH_INDEX=""
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    TORCH_INDEX=$TORCH_INDEX_URL
    TORCH_REASON="TORCH_INDEX_URL is set: installing torch from $TORCH_INDEX_URL"
  elif [ "$(uname -s)" != Linux ]; then
    TORCH_REASON="$(uname -s): installing torch from pip's default index (its builds for this system have no CUDA)"
  elif nvidia_driver; then
    TORCH_REASON="NVIDIA driver found: installing torch from pip's default index (the CUDA build, several GB)"
  elif answers "$1" "$CPU_INDEX/torch/"; then
    TORCH_INDEX=$CPU_INDEX
    TORCH_REASON="no NVIDIA driver found: installing the CPU build of torch from $CPU_INDEX"
  else
    TORCH_REASON="no NVIDIA driver found, but $CPU_INDEX did not answer: installing torch from pip's default index instead (PyPI's Linux build is the CUDA one, several GB, unless your pip configuration points elsewhere; TORCH_INDEX_URL=URL picks another)"
  fi
}

setup() {  # create .venv and install the course into it, once and again when pyproject.toml changes
  local stamp="$VENV/.lablib-installed" torch_version
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ] && ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    say "Python 3.10 or newer is needed; '$PYTHON' is $("$PYTHON" --version 2>&1 || echo missing)."
    echo "        Install one, then run: PYTHON=python3.11 ./lab.sh" >&2
    exit 1
  fi
  TORCH_INDEX="" TORCH_REASON=""  # a reason is set only where torch is still to be installed
  if [ -x "$VENV/bin/python" ] && torch_version=$("$VENV/bin/python" -c \
      'import importlib.util as u, importlib.metadata as m; assert u.find_spec("torch"); print(m.version("torch"))' 2>/dev/null); then
    say "torch $torch_version is already in $VENV: keeping it"
  elif [ -x "$VENV/bin/python" ]; then
    choose_torch_index "$VENV/bin/python"
    say "$TORCH_REASON ($TORCH_SPEC, the version CI tests)"
  else
    choose_torch_index "$PYTHON"
    say "$TORCH_REASON ($TORCH_SPEC, the version CI tests)"
  fi
  say "setting up $VENV (the first time takes a few minutes)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  if [ -n "$TORCH_INDEX" ]; then
    "$VENV/bin/python" -m pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"
  elif [ -n "${TORCH_REASON:-}" ]; then
    "$VENV/bin/python" -m pip install "$TORCH_SPEC"
  fi
  "$VENV/bin/python" -m pip install -e ".[test]"
  touch "$stamp"
}

sync_labs() {  # copy each labs/*.ipynb missing from $MY_LABS there; never overwrite one
  local first=0 nb name copied=()
  if [ ! -d "$MY_LABS" ]; then
    first=1
    mkdir -p "$MY_LABS"
    # answers given before there was a working copy (in labs/) move along with the notebooks
    if [ -f labs/quiz_answers.json ]; then
      cp labs/quiz_answers.json "$MY_LABS/quiz_answers.json"
    fi
  fi
  for nb in labs/*.ipynb; do
    [ -f "$nb" ] || continue
    name=${nb##*/}
    if [ ! -e "$MY_LABS/$name" ]; then
      cp "$nb" "$MY_LABS/.$name.part"
      mv "$MY_LABS/.$name.part" "$MY_LABS/$name"
      copied+=("$name")
    fi
  done
  if [ "$first" = 1 ]; then
    say "your working copy is $MY_LABS/ (git and ./lab.sh never overwrite it); copied ${#copied[@]} labs from labs/: ${copied[*]-}"
  elif [ "${#copied[@]}" -gt 0 ]; then
    say "copied ${#copied[@]} new lab(s) from labs/ to $MY_LABS/: ${copied[*]}; the notebooks already there are untouched"
  else
    say "your labs are in $MY_LABS/ (nothing new in labs/)"
  fi
}

jupyter_lab_args() {  # jupyter_lab_args USER_ID ARGS...: sets LAB_ARGS, with --allow-root added for root
  local uid=$1 arg
  shift
  LAB_ARGS=("$@")
  [ "$uid" -eq 0 ] || return 0
  for arg in "$@"; do
    case "$arg" in --allow-root|--ServerApp.allow_root*) return 0 ;; esac
  done
  LAB_ARGS+=(--allow-root)
  say "running as root (as in a container): adding --allow-root, without which JupyterLab refuses to start"
}

main() {
  cd "$(dirname "$0")"
  local command=lab
  if [ $# -gt 0 ]; then
    case "$1" in
      lab|test|doctor|bench) command=$1; shift ;;
      -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
      -*) ;;  # options for jupyter lab
      *) usage >&2; exit 2 ;;
    esac
  fi
  setup
  case "$command" in
    lab)
      sync_labs
      jupyter_lab_args "$EUID" "$@"
      exec "$VENV/bin/jupyter" lab "$MY_LABS" "${LAB_ARGS[@]+"${LAB_ARGS[@]}"}" ;;
    test)   "$VENV/bin/lablib" quiz check && exec "$VENV/bin/python" -m pytest "$@" ;;
    doctor) exec "$VENV/bin/lablib" doctor "$@" ;;
    bench)  exec "$VENV/bin/python" -m lablib.bench "$@" ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
