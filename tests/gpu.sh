#!/usr/bin/env bash
# The GPU check, sized for the machine it meets: one GPU, no network, minutes of machine time. Ways to run it:
#
#   bash tests/gpu.sh                     with a package index: ./lab.sh sets up .venv, then the check
#   bash tests/gpu.sh --wheels DIR [PY]   on a machine WITH an index: the packages the check needs (not torch,
#                                         not JupyterLab) as wheels for Python PY (default 3.12) into DIR, and
#                                         their size (carried to the GPU machine: well under 64 MiB)
#   bash tests/gpu.sh --offline DIR       on the GPU machine, WITHOUT an index: a venv in .gpu-venv that sees
#                                         the machine's own torch, the packages from DIR, then the check
#   bash tests/gpu.sh --dry               the same logic on this machine's CPU (device "cpu"), in seconds: the
#                                         suite runs it (tests/test_gpu_sh.py), so it cannot rot between GPU runs
#   ... --only PART                       one part again (versions, traces, fixtures, gpu-tests, bench)
#
# Parts, in order: the versions (torch, NCCL, the device); profiler traces of lab 03's prefetching step with its
# ranks sharing the GPU, a lab 05 1F1B step and NCCL at world size 1 (tests/gpu_capture.py), into GPU_OUT/traces,
# at most 8 files of a few hundred KB: the fixtures tests/fixtures/gpu/ can take; tests/test_gputime.py on them;
# the GPU tests (tests/test_gpu.py, tests/test_device.py); bench P3 and P7 (with 2 GPUs or more, P3 on NCCL). The check aims at 4 minutes
# (GPU_BUDGET_S=240): a part starts only while time is left, and every part stops at GPU_STOP_S=330 s, so it
# ends before 6 minutes, with GPU_OUT/summary.md (default folder: gpu-out) saying what ran, what passed and
# what did not run. Exit status: 0 all parts ran and passed, 1 a part failed, 2 bad usage, 3 parts left out.
set -uo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(cloudpickle plotly pyyaml numpy pytest pytest-timeout setuptools)
PARTS=(versions traces fixtures gpu-tests bench)
OUTDIR="${GPU_OUT:-gpu-out}"
BUDGET="${GPU_BUDGET_S:-240}"
STOP="${GPU_STOP_S:-330}"
DEVICE=cuda
ONLY=""
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
      python3 -m pip download -q --only-binary=:all: --python-version "${3:-3.12}" --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$2" "${PACKAGES[@]}" || exit 1
      echo "gpu.sh: $(ls "$2"/*.whl | wc -l) wheels in $2, $(du -sm "$2" | cut -f1) MiB (the carry limit is 64 MiB)"
      exit 0 ;;
    --offline)
      [ -d "${2:-}" ] || { echo "gpu.sh: --offline DIR: DIR holds the wheels from --wheels" >&2; exit 2; }
      python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
        || { echo "gpu.sh: this python3 has no CUDA torch: run it where torch sees a GPU" >&2; exit 2; }
      python3 -m venv --system-site-packages .gpu-venv || exit 2
      .gpu-venv/bin/python -m pip install -q --no-index --find-links "$2" "${PACKAGES[@]}" || exit 2
      .gpu-venv/bin/python -m pip install -q --no-index --find-links "$2" --no-deps --no-build-isolation -e . || exit 2
      PY=.gpu-venv/bin/python
      shift 2 ;;
    --dry)
      DEVICE=cpu
      PY="${PY:-.venv/bin/python}"
      shift ;;
    --only)
      [[ " ${PARTS[*]} " == *" ${2:-} "* ]] || { echo "gpu.sh: no part '${2:-}'" >&2; usage; }
      ONLY=$2
      shift 2 ;;
    *) usage ;;
  esac
done
if [ -z "$PY" ]; then
  ./lab.sh doctor >/dev/null || exit 2
  PY=.venv/bin/python
fi

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
  tail -n 12 "$OUTDIR/logs/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  [ $rc -eq 0 ] || status=1
}

# pytest without the notebook plugin's options (nbval is not carried) and without writing a cache
PYTEST=("$PY" -m pytest -q -o "addopts=-p no:cacheprovider")
part versions "$PY" -c "import platform, torch
cuda = torch.cuda.is_available()
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}')
print('NCCL', '.'.join(map(str, torch.cuda.nccl.version())) if cuda else 'not used: no GPU')
print('device:', ', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else 'cpu')
assert cuda or '$DEVICE' == 'cpu', 'torch sees no GPU: run with --dry on a CPU machine'"
[ -n "$ONLY" ] && [ "$ONLY" != traces ] || rm -rf "$OUTDIR/traces"  # fresh traces, unless another part reruns
part traces "$PY" tests/gpu_capture.py "$OUTDIR/traces" --device "$DEVICE"
part fixtures env LABLIB_GPU_TRACES="$OUTDIR/traces" "${PYTEST[@]}" tests/test_gputime.py
part gpu-tests "${PYTEST[@]}" tests/test_gpu.py $([ $DEVICE = cuda ] && echo tests/test_device.py)
if [ $DEVICE = cpu ]; then  # the dry run: the suite runs the bench itself (tests/test_bench.py)
  part bench "$PY" -m lablib.bench --help
else  # P3 and P7; with 2 GPUs or more, P3 against NCCL's own collectives too
  part bench bash -c '"$0" -m lablib.bench --quick --only P3,P7 && { [ "$("$0" -c "import torch
print(torch.cuda.device_count())")" -lt 2 ] || "$0" -m lablib.bench --quick --only P3 --backend nccl; }' "$PY"
fi
echo "gpu.sh: $((SECONDS - START)) s; summary in $SUMMARY, logs in $OUTDIR/logs, traces in $OUTDIR/traces"
exit $status
