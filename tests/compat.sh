#!/usr/bin/env bash
# tests/compat.sh PYTHON TORCH_SPEC [pytest args...]
#
# Compatibility check of the versions pyproject.toml claims (requires-python, torch>=...): runs the
# whole test suite with another Python and torch in a side virtual environment. It runs by hand,
# outside CI (the torch wheel from PyPI is the CUDA build, several GB; the suite takes ~15 minutes).
#   PYTHON      the interpreter to test, e.g. python3.10 or /root/.pyenv/versions/3.13.0/bin/python3.13
#   TORCH_SPEC  a pip specifier for torch, e.g. "==2.8.0"; "" for the newest that pip finds
# The environment is ${COMPAT_DIR:-/tmp/compat}/<python-version>-torch<spec>/: venv/ and src/, a fresh
# clone of this repository's HEAD (uncommitted changes are not tested). A venv already there is reused;
# its torch is reinstalled only if it does not match TORCH_SPEC ("" upgrades to the newest).
# COMPAT_BUILD_ONLY=1 builds the environment and stops. Exits non-zero when a test fails.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0" >&2; exit 2; }
python=$1 spec=$2
shift 2
say() { echo "compat: $*" >&2; }

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
dir=${COMPAT_DIR:-/tmp/compat}/$pyver-$(printf 'torch%s' "${spec:-newest}" | tr -cs 'A-Za-z0-9.' '_')
venv=$dir/venv src=$dir/src
mkdir -p "$dir"

say "cloning $repo at HEAD ($(git -C "$repo" rev-parse --short HEAD)) into $src"
rm -rf "$src"
git clone --quiet "$repo" "$src"

[ -x "$venv/bin/python" ] || { say "creating $venv with $python"; "$python" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install --progress-bar off)
upgrade=(); [ -n "$spec" ] || upgrade=(--upgrade)
"${pip[@]}" "${upgrade[@]+"${upgrade[@]}"}" "torch$spec"   # first, so the package's torch>= keeps it
(cd "$src" && "${pip[@]}" -e ".[test]")

"$venv/bin/python" - <<'PY'
import platform, importlib.metadata as m
print("compat: python", platform.python_version(), *(f"{p} {m.version(p)}" for p in
      ("torch", "jupyterlab", "ipywidgets", "nbval", "plotly", "pytest", "numpy")), sep=" | ")
PY
[ "${COMPAT_BUILD_ONLY:-0}" = 1 ] && { say "built $dir (COMPAT_BUILD_ONLY=1: no tests)"; exit 0; }

# the suite as README.md and `./lab.sh test` run it: the quiz banks, then pytest from the root
cd "$src"
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
unset LABLIB_REQUIRE_BROWSER
log=$dir/pytest-$(date -u +%Y%m%dT%H%M%SZ).log
lablib quiz check
rc=0
python -m pytest "$@" 2>&1 | tee "$log" || rc=$?

versions=$(python -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__)')
last=$(grep -E ' in [0-9.]+s' "$log" | tail -n 1 || true)
count() { grep -oE "[0-9]+ $1" <<<"$last" | grep -oE '^[0-9]+' || echo 0; }
if [ -n "$last" ]; then
  echo "compat: $versions: $(count passed) passed, $(( $(count failed) + $(count 'errors?') )) failed," \
       "$(count skipped) skipped in $(grep -oE ' in [0-9.]+s' <<<"$last" | tail -n 1 | tr -dc '0-9.') s (log: $log)"
else
  echo "compat: $versions: no pytest summary, rc=$rc (log: $log)"
fi
exit "$rc"
