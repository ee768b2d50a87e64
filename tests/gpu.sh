#!/usr/bin/env bash
# The GPU check, sized for the machine it meets: one GPU, no network, minutes of machine time. Ways to run it:
#
#   bash tests/gpu.sh                     with a package index: ./lab.sh sets up .venv, then the check
#   bash tests/gpu.sh --wheels DIR [PY]   on a machine WITH an index: the packages the check needs beside a
#                                         machine's own torch and numpy (not JupyterLab) as wheels for Python PY
#                                         (default 3.12) into DIR, and their size (carried to the GPU machine)
#   bash tests/gpu.sh --offline DIR       on the GPU machine, WITHOUT an index: the packages from DIR into
#                                         .gpu-site (on PYTHONPATH, beside the python3 that holds the machine's
#                                         CUDA torch, which may itself be a virtual environment), then the check
#   bash tests/gpu.sh --dry               the same logic on this machine's CPU (device "cpu"): the suite runs it
#                                         (tests/test_gpu_sh.py), so it cannot rot between GPU runs; with
#                                         --offline DIR, the offline install too, with a python3 that has no GPU
#   ... --only PART                       one part again (versions, traces, fixtures, gpu-tests, notebooks, bench)
#
# Parts, in order: the versions (torch, NCCL, the device); profiler traces of lab 03's prefetching step with its
# ranks sharing the GPU, a lab 05 1F1B step and NCCL at world size 1 (tests/gpu_capture.py) into GPU_OUT/traces,
# at most 8 files of a few hundred KB (what tests/fixtures/gpu/ can take), and lab 03's timeline, titled with the
# GPU, as GPU_OUT/timeline-lab03.json; tests/test_gputime.py on those traces; the GPU tests (tests/test_gpu.py,
# with NCCL at world size 1 for every collective lablib wraps, and tests/test_device.py); every source notebook
# under nbval, GPU_JOBS (4) at a time, its ranks sharing the GPU (tests/gpu_notebooks.py; GPU_NOTEBOOKS names
# others, the dry run takes lab 00's only); the bench items that run on one GPU (P3-P7, P9, P12; with 2 GPUs or
# more, P3 on NCCL too). A part starts only while time is left (GPU_BUDGET_S=400) and every part stops at
# GPU_STOP_S=520 s into the check, so it ends within 9 minutes, with GPU_OUT/summary.md (default folder: gpu-out)
# saying what ran, what passed and what did not run, and each part's log in GPU_OUT/logs. Exit status: 0 all parts
# ran and passed, 1 a part failed, 2 bad usage, 3 parts left out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# beside torch and numpy: what lablib imports, what runs a notebook under nbval, and pytest with its timeout
PACKAGES=(cloudpickle plotly pyyaml RestrictedPython ipywidgets ipykernel nbformat jupyter_client nbval pytest
          pytest-timeout)
PARTS=(versions traces fixtures gpu-tests notebooks bench)
OUTDIR="${GPU_OUT:-gpu-out}"
BUDGET="${GPU_BUDGET_S:-400}"
STOP="${GPU_STOP_S:-520}"
DEVICE=cuda
ONLY=""
WHEELS=""
PY="${GPU_PY:-}"

usage() {
  echo "usage: bash tests/gpu.sh [--wheels DIR [PYTHON_VERSION] | --offline DIR | --dry] [--only PART]" >&2
  echo "       PART: ${PARTS[*]}" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      [ -n "${2:-}" ] || usage
      python3 -m pip download -q --only-binary=:all: --python-version "${3:-3.12}" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$2" "${PACKAGES[@]}" || exit 1
      echo "gpu.sh: $(ls "$2"/*.whl | wc -l) wheels in $2, $(du -sm "$2" | cut -f1) MiB (the carry limit is 64 MiB)"
      exit 0 ;;
    --offline)
      [ -d "${2:-}" ] || { echo "gpu.sh: --offline DIR: DIR holds the wheels from --wheels" >&2; usage; }
      WHEELS=$2
      shift 2 ;;
    --dry)
      DEVICE=cpu
      shift ;;
    --only)
      [[ " ${PARTS[*]} " == *" ${2:-} "* ]] || { echo "gpu.sh: no part '${2:-}'" >&2; usage; }
      ONLY=$2
      shift 2 ;;
    *) usage ;;
  esac
done
if [ -n "$WHEELS" ]; then
  # pip --target installs the wheels' whole closure, whatever the machine has: nothing of its own is replaced,
  # since .gpu-site only comes first on PYTHONPATH; lablib itself is imported from this checkout
  PY=${PY:-python3}
  if [ $DEVICE = cuda ]; then
    "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
      || { echo "gpu.sh: $PY has no CUDA torch: run it where torch sees a GPU (or add --dry)" >&2; exit 2; }
  fi
  rm -rf .gpu-site
  "$PY" -m pip install -q --no-index --no-compile --disable-pip-version-check --target .gpu-site \
    --find-links "$WHEELS" "${PACKAGES[@]}" || exit 2
  export PYTHONPATH="$ROOT/.gpu-site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  # the notebooks' kernels keep their connection files and IPython's profile out of a home that may be read-only
  export JUPYTER_RUNTIME_DIR="$ROOT/.gpu-site/jupyter-runtime" IPYTHONDIR="$ROOT/.gpu-site/ipython"
elif [ -z "$PY" ] && [ $DEVICE = cpu ]; then
  PY=.venv/bin/python
elif [ -z "$PY" ]; then
  ./lab.sh doctor >/dev/null || exit 2
  PY=.venv/bin/python
fi
# pytest loads no plugin of the machine's own (a GPU image holds many, for another pytest): only what it needs
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

mkdir -p "$OUTDIR/logs"
SUMMARY="$OUTDIR/summary.md"
START=$SECONDS
{
  echo "# GPU check$([ $DEVICE = cpu ] && echo ', dry run on the CPU'), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
} > "$SUMMARY"

status=0
part() {  # part NAME COMMAND...: run it if chosen and time is left, stopped at STOP s; note it in the summary
  local name=$1 t0=$SECONDS rc
  shift
  [ -z "$ONLY" ] || [ "$ONLY" = "$name" ] || return 0
  if [ $((SECONDS - START)) -ge "$BUDGET" ]; then
    echo "- $name: not run: $((SECONDS - START)) s of the ${BUDGET} s budget used" >> "$SUMMARY"
    [ $status -ne 0 ] || status=3
    return 0
  fi
  timeout --kill-after=5 $((STOP - (SECONDS - START))) "$@" > "$OUTDIR/logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) echo "- $name: passed in $((SECONDS - t0)) s" ;;
    124|137) echo "- $name: STOPPED at ${STOP} s into the check, after $((SECONDS - t0)) s" ;;
    *) echo "- $name: FAILED (exit $rc) in $((SECONDS - t0)) s" ;;
  esac >> "$SUMMARY"
  tail -n "$([ "$name" = bench ] && echo 40 || echo 14)" "$OUTDIR/logs/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  [ $rc -eq 0 ] || status=1
}

# pytest without the notebook plugin's options and without writing a cache
PYTEST=("$PY" -m pytest -q -p pytest_timeout -o "addopts=-p no:cacheprovider")
part versions "$PY" -c "import platform, torch
cuda = torch.cuda.is_available()
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}')
print('NCCL', '.'.join(map(str, torch.cuda.nccl.version())) if cuda else 'not used: no GPU')
print('device:', ', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else 'cpu')
assert cuda or '$DEVICE' == 'cpu', 'torch sees no GPU: run with --dry on a CPU machine'"
[ -n "$ONLY" ] && [ "$ONLY" != traces ] || rm -rf "$OUTDIR/traces"  # fresh traces, unless another part reruns
part traces "$PY" tests/gpu_capture.py "$OUTDIR/traces" --device "$DEVICE" --timeline "$OUTDIR/timeline-lab03.json"
part fixtures env LABLIB_GPU_TRACES="$OUTDIR/traces" "${PYTEST[@]}" tests/test_gputime.py
part gpu-tests "${PYTEST[@]}" tests/test_gpu.py $([ $DEVICE = cuda ] && echo tests/test_device.py)
# shellcheck disable=SC2086 - GPU_NOTEBOOKS is a list of paths
part notebooks "$PY" tests/gpu_notebooks.py "$OUTDIR/logs/notebooks" --jobs "${GPU_JOBS:-4}" \
  ${GPU_NOTEBOOKS:-$([ $DEVICE = cpu ] && echo sources/00_welcome.ipynb || echo sources/*.ipynb)}
if [ $DEVICE = cpu ]; then  # the dry run: the suite runs the bench itself (tests/test_bench.py)
  part bench "$PY" -m lablib.bench --help
else  # with 2 GPUs or more, P3 against NCCL's own collectives too
  part bench bash -c '"$0" -m lablib.bench --quick --reps 2 --only P3,P4,P5,P6,P7,P9,P12 && { [ "$("$0" -c "import torch
print(torch.cuda.device_count())")" -lt 2 ] || "$0" -m lablib.bench --quick --only P3 --backend nccl; }' "$PY"
fi
echo "gpu.sh: $((SECONDS - START)) s; summary in $SUMMARY, logs in $OUTDIR/logs, traces in $OUTDIR/traces"
exit $status
