"""The arguments of lablib's traced collectives, checked before anything is sent: ``lablib.all_gather``,
``reduce_scatter`` and ``all_to_all`` take one tensor each way, as ``dist.all_gather_into_tensor``,
``dist.reduce_scatter_tensor`` and ``dist.all_to_all_single`` do, where their ``torch.distributed`` namesakes take
lists. A learner who writes them as ``dist``'s would get a TypeError from deep inside (or a Gloo size error once
the list is gone); here the error names the signature and the tensor to pass instead."""
from __future__ import annotations

import torch

# op: (the torch.distributed collective lablib's takes after, the tensor that is P times the other along dim 0)
SINGLE = {"all_gather": ("all_gather_into_tensor", "output"), "reduce_scatter": ("reduce_scatter_tensor", "input")}


def tensors(op: str, **given) -> None:
    """A TypeError that teaches, for an argument that is not one tensor."""
    for name, value in given.items():
        if isinstance(value, torch.Tensor):
            continue
        listed = isinstance(value, (list, tuple))
        if op == "all_to_all" and listed:
            raise TypeError("lablib.all_to_all(output, input, output_split_sizes, input_split_sizes) takes one tensor "
                            "each way, cut along dim 0 as dist.all_to_all_single does, not lists as dist.all_to_all "
                            "takes: input = torch.cat(pieces) with input_split_sizes = [p.shape[0] for p in pieces], "
                            "and output.split(output_split_sizes) gives the received pieces back")
        if op in SINGLE and listed:
            single, big = SINGLE[op]
            small = "input" if big == "output" else "output"
            if name == "output" == big:
                how = "output.chunk(P) gives each rank's piece after the call (views of it, no copy)"
            elif name == big:
                how = "torch.cat(pieces) makes it, and rank r's output gets the sum over ranks of piece r"
            else:
                how = f"the {name} is this rank's chunk, one P-th of the {big}"
            raise TypeError(f"lablib.{op}(output, input) takes one {name} tensor, not a list of {len(value)} as "
                            f"dist.{op} takes: the {big} is P times the {small}'s size along dim 0 (the ranks' "
                            f"{'inputs' if big == 'output' else 'chunks'} one after the other), as dist.{single} "
                            f"takes it; {how}")
        raise TypeError(f"lablib.{op}: {name} must be a tensor, not {type(value).__name__}")


def _shape(shape) -> str:
    return ", ".join(map(str, shape))


def p_times(op: str, output: torch.Tensor, input: torch.Tensor, n: int) -> None:
    """all_gather's output, reduce_scatter's input: ``n`` times the other along dim 0, of the same dtype; else a
    ValueError naming the shape it must have (or the swap, or the dtype)."""
    single, big_name = SINGLE[op]
    big, small = (output, input) if big_name == "output" else (input, output)
    small_name = "input" if big_name == "output" else "output"
    want = (n * small.shape[0], *small.shape[1:]) if small.dim() else (n,)
    if tuple(big.shape) == want and big.dtype == small.dtype:
        return
    if small.dim() and big.dim() and small.shape[0] == n * big.shape[0] and small.shape[1:] == big.shape[1:]:
        raise ValueError(f"lablib.{op}: the output has shape {tuple(output.shape)} and the input {tuple(input.shape)}: "
                         f"they look swapped; lablib.{op}(output, input) takes the output first, as dist.{single}")
    if big.dtype != small.dtype:
        raise ValueError(f"lablib.{op}: the output is {output.dtype} and the input {input.dtype}: they must have the "
                         "same dtype")
    stacked = (f" (not stacked as {(n, *small.shape)}; .view({_shape((n, *small.shape))}) reads it that way)"
               if tuple(big.shape) == (n, *small.shape) else "")
    if op == "all_gather":
        raise ValueError(f"lablib.all_gather: the output has shape {tuple(output.shape)}; with {n} ranks and the input "
                         f"of shape {tuple(input.shape)} it must be {want}{stacked}: P times the input along dim 0, the "
                         f"ranks' inputs one after the other (input.new_empty({_shape(want)}))")
    fits = (f"; for this input, an output of shape {(big.shape[0] // n, *big.shape[1:])}"
            if big.dim() and big.shape[0] % n == 0 and not stacked else "")
    raise ValueError(f"lablib.reduce_scatter: the input has shape {tuple(input.shape)} and the output "
                     f"{tuple(output.shape)}; with {n} ranks the input must be {want}{stacked}: P times the output "
                     f"along dim 0, the chunks for ranks 0 to {n - 1} one after the other{fits}")
