"""An all-to-all's split sizes (``lablib.all_to_all``): read, checked against the tensors, and checked against
what the other ranks send, so a mismatch is an error that says which rank sends what, where Gloo would abort."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def row_bytes(t) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def splits(sizes, tensor, n, side) -> list[int]:
    """Split sizes as a list of n ints (a tensor of counts is taken too: ``.tolist()``, a copy to the host)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if sizes is None:
        if rows % n:
            raise ValueError(f"lablib.all_to_all: {side} has {rows} rows, which do not cut into {n} equal parts: "
                             f"give {side}_split_sizes, the rows for each rank")
        return [rows // n] * n
    sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if len(sizes) != n or any(not isinstance(c, int) or c < 0 for c in sizes):
        raise ValueError(f"lablib.all_to_all: {side}_split_sizes={sizes}: expected {n} whole numbers of rows, one per rank")
    if sum(sizes) != rows:
        raise ValueError(f"lablib.all_to_all: {side}_split_sizes={sizes} add up to {sum(sizes)} rows, but {side} has "
                         f"{rows} (its dim 0)")
    return sizes


def same_splits(ins, outs, me, on, group=None) -> None:
    """Every rank's output splits against what the others send it: one small exchange of the split sizes."""
    sent = torch.tensor(ins, dtype=torch.int64, device=on)
    told = torch.empty_like(sent)
    dist.all_to_all_single(told, sent, group=group)
    told = told.tolist()
    if told != outs:
        j = next(j for j in range(len(outs)) if told[j] != outs[j])
        raise ValueError(f"lablib.all_to_all on rank {me}: output_split_sizes[{j}] = {outs[j]} rows, but rank {j} sends "
                         f"{told[j]} (its input_split_sizes[{me}]). A rank's output splits are what the others send it: "
                         "exchange the counts first (an all-to-all of them) and take the counts you received, not "
                         "the ones you send.")
