"""lablib's collectives that take one tensor where their torch.distributed namesakes take lists (all_gather,
reduce_scatter, all_to_all), called as dist's are, or with a tensor of the wrong size, dtype or place: an error that
names the signature and the tensor to pass, before anything is sent, instead of a TypeError from deep inside or
Gloo's size error. On real ranks, as a learner's job meets it."""
import pytest
import torch
import torch.distributed as dist

import lablib
from lablib import RankError


@pytest.fixture(scope="module")
def two():
    with lablib.Cluster(2, backend="gloo", timeout=5, quiet=True) as c:
        yield c


def _call(case):
    n, x = dist.get_world_size(), torch.ones(3) * dist.get_rank()
    pieces = [torch.empty(3) for _ in range(n)]
    {
        "all_gather into a list": lambda: lablib.all_gather(pieces, x),
        "all_gather into a list, async": lambda: lablib.all_gather(pieces, x, async_op=True).wait(),
        "all_gather into one input's size": lambda: lablib.all_gather(torch.empty(3), x),
        "all_gather into a stacked output": lambda: lablib.all_gather(torch.empty(n, 3), x),
        "all_gather, 2-D, along dim 1": lambda: lablib.all_gather(torch.empty(2, 3 * n), torch.ones(2, 3)),
        "all_gather into float64": lambda: lablib.all_gather(torch.empty(3 * n, dtype=torch.float64), x),
        "all_gather, input first": lambda: lablib.all_gather(x, torch.empty(3 * n)),
        "reduce_scatter from a list": lambda: lablib.reduce_scatter(torch.empty(3), [torch.ones(3)] * n),
        "reduce_scatter into a list": lambda: lablib.reduce_scatter(pieces, torch.ones(3 * n)),
        "reduce_scatter into the input's size": lambda: lablib.reduce_scatter(torch.empty(3 * n), torch.ones(3 * n)),
        "all_to_all with lists": lambda: lablib.all_to_all(pieces, [torch.ones(3)] * n),
        "all_reduce of a list": lambda: lablib.all_reduce([x]),
        "send of a number": lambda: lablib.send(3, (dist.get_rank() + 1) % n),
    }[case]()


@pytest.mark.parametrize("case, said", [
    ("all_gather into a list", "lablib.all_gather(output, input) takes one output tensor, not a list of 2 as "
                               "dist.all_gather takes: the output is P times the input's size along dim 0"),
    ("all_gather into a list, async", "output.chunk(P) gives each rank's piece after the call"),
    ("all_gather into one input's size", "the output has shape (3,); with 2 ranks and the input of shape (3,) it must "
                                         "be (6,): P times the input along dim 0"),
    ("all_gather into a stacked output", "it must be (6,) (not stacked as (2, 3); .view(2, 3) reads it that way)"),
    ("all_gather, 2-D, along dim 1", "the output has shape (2, 6); with 2 ranks and the input of shape (2, 3) it must "
                                     "be (4, 3)"),
    ("all_gather into float64", "the output is torch.float64 and the input torch.float32: they must have the same"),
    ("all_gather, input first", "they look swapped; lablib.all_gather(output, input) takes the output first"),
    ("reduce_scatter from a list", "lablib.reduce_scatter(output, input) takes one input tensor, not a list of 2 as "
                                   "dist.reduce_scatter takes: the input is P times the output's size along dim 0 (the "
                                   "ranks' chunks one after the other), as dist.reduce_scatter_tensor takes it; "
                                   "torch.cat(pieces) makes it"),
    ("reduce_scatter into a list", "takes one output tensor, not a list of 2"),
    ("reduce_scatter into the input's size", "the input has shape (6,) and the output (6,); with 2 ranks the input "
                                             "must be (12,): P times the output along dim 0, the chunks for ranks 0 "
                                             "to 1 one after the other; for this input, an output of shape (3,)"),
    ("all_to_all with lists", "takes one tensor each way, cut along dim 0 as dist.all_to_all_single does, not lists "
                              "as dist.all_to_all takes: input = torch.cat(pieces)"),
    ("all_reduce of a list", "lablib.all_reduce: tensor must be a tensor, not list"),
    ("send of a number", "lablib.send: tensor must be a tensor, not int"),
])
def test_a_collective_called_with_another_signature_says_which_to_use(two, case, said):
    with pytest.raises(RankError) as info:
        two.run(_call, case)
    message = str(info.value)
    first = message.splitlines()[0]
    assert said in first, message
    # Nothing was sent: no Gloo error on any rank. (Each rank raises the same at once, but on a busy machine the
    # pool may stop a slow rank before it got there, so "the same" is not asserted for every rank.)
    assert "Gloo" not in message and "size doesn't match" not in message, message


def _the_right_calls():
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(3.0) + 10 * r
    gathered = torch.empty(3 * n)
    lablib.all_gather(gathered, x)
    out = torch.empty(3)
    lablib.reduce_scatter(out, torch.cat([x] * n))
    return gathered.chunk(n)[1].tolist(), out.tolist()


def test_the_signatures_the_messages_name_work(two):
    assert two.run(_the_right_calls)[0] == ([10.0, 11.0, 12.0], [10.0, 12.0, 14.0])
