#!/usr/bin/env bash
# The GPU checks on a machine with CUDA GPUs, in a few minutes: the tests marked gpu (NCCL, CUDA tensors,
# torchrun on the GPUs), then the bandwidth sweep of lablib's rings against NCCL's collectives.
set -euo pipefail
cd "$(dirname "$0")/.."
./lab.sh test -m gpu -q
exec ./lab.sh bench --only P3 --quick --backend nccl
