#!/usr/bin/env bash
# The GPU check, on a machine with CUDA PyTorch. Three ways to run it:
#
#   bash tests/gpu.sh                     with a package index: ./lab.sh sets up .venv, then the check
#   bash tests/gpu.sh --wheels DIR [PY]   on a machine WITH an index: the course's packages (not torch, not
#                                         JupyterLab) as wheels for Python PY (default 3.12) into DIR
#   bash tests/gpu.sh --offline DIR       on the GPU machine, WITHOUT an index: a venv in .gpu-venv that sees
#                                         the machine's own torch, the packages from DIR, then the check
#
# The check (a few minutes on one GPU): the tests marked gpu and the device rule's tests; every source
# notebook once under nbval (on one GPU its ranks share it, over Gloo); NCCL at world size 1; bench items
# P3, P4, P6 and P9. With 2 GPUs or more, every lab's checks under NCCL at 2 ranks (the gpu tests) and P3
# against NCCL's own collectives. It writes one summary, gpu-summary.md (GPU_SUMMARY=FILE for another
# place): each part passed or failed with its time, each notebook's result, the bench rows.
set -uo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(cloudpickle ipywidgets plotly pyyaml numpy nbval ipykernel pytest pytest-timeout setuptools)
SUMMARY="${GPU_SUMMARY:-gpu-summary.md}"

case "${1:-}" in
  --wheels)
    [ -n "${2:-}" ] || { echo "usage: bash tests/gpu.sh --wheels DIR [PYTHON_VERSION]" >&2; exit 2; }
    exec python3 -m pip download --only-binary=:all: --python-version "${3:-3.12}" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$2" "${PACKAGES[@]}" ;;
  --offline)
    [ -d "${2:-}" ] || { echo "usage: bash tests/gpu.sh --offline DIR (DIR: the wheels from --wheels)" >&2; exit 2; }
    python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
      || { echo "gpu.sh: this python3 has no CUDA torch: run it where torch sees a GPU" >&2; exit 2; }
    python3 -m venv --system-site-packages .gpu-venv || exit 2
    .gpu-venv/bin/python -m pip install -q --no-index --find-links "$2" "${PACKAGES[@]}" || exit 2
    .gpu-venv/bin/python -m pip install -q --no-index --find-links "$2" --no-deps --no-build-isolation -e . || exit 2
    PY=.gpu-venv/bin/python ;;
  "")
    ./lab.sh doctor >/dev/null || exit 2
    PY=.venv/bin/python ;;
  *)
    echo "usage: bash tests/gpu.sh [--wheels DIR [PYTHON_VERSION] | --offline DIR]" >&2; exit 2 ;;
esac

OUT=$(mktemp -d)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  "$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): '
            + ', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"
  echo
} > "$SUMMARY"

part() {  # part NAME COMMAND...: run it, time it, note the result in the summary
  local name=$1 t0=$SECONDS rc
  shift
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "- $name: $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s" >> "$SUMMARY"
  tail -n 3 "$OUT/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  return $rc
}

status=0
part "gpu tests" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_device.py || status=1
part "notebooks" "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/notebooks.xml" sources/ || status=1
"$PY" - "$OUT/notebooks.xml" >> "$SUMMARY" <<'PY'
import collections, sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError):
    sys.exit()
books = collections.defaultdict(lambda: [0.0, 0])
for c in cases:
    book = books[c.get("classname", "").split("::")[0] or c.get("file", "?")]
    book[0] += float(c.get("time", 0))
    book[1] += any(child.tag in ("failure", "error") for child in c)
for name, (seconds, failed) in sorted(books.items()):
    print(f"    {name}: {'passed' if not failed else f'{failed} cell(s) FAILED'} in {seconds:.0f} s")
PY
ITEMS=P3,P4,P6,P9
part "bench $ITEMS" "$PY" -m lablib.bench --quick --only "$ITEMS" --json "$OUT/bench.json" || status=1
if [ "$GPUS" -ge 2 ]; then
  part "bench P3 on NCCL" "$PY" -m lablib.bench --quick --only P3 --backend nccl --json "$OUT/bench-nccl.json" || status=1
fi
for log in "$OUT"/bench*.log; do
  echo; echo '```'; grep -E '^\| ?P|^\|---|^\| item' "$log" || tail -n 20 "$log"; echo '```'
done >> "$SUMMARY"
echo "gpu.sh: summary in $SUMMARY (logs in $OUT)"
exit $status
