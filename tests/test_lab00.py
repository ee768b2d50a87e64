"""Lab 00 (welcome): Task 0.1's check passes a right answer and teaches on each typical mistake."""
import pytest
import torch

import lablib
from lablib.checks import CheckFailed
from lablib.checks.lab00 import check_mean_across_ranks


def test_mean_across_ranks(cluster, capsys):
    def right(x):
        lablib.all_reduce(x)
        return x / torch.distributed.get_world_size()

    def summed(x):
        lablib.all_reduce(x)
        return x

    def local(x):
        return x

    def stub(x):
        raise NotImplementedError("Task 0.1: average x")

    def nothing(x):
        return None

    check_mean_across_ranks(right, cluster)
    assert "✓ Task 0.1 passed" in capsys.readouterr().out
    for fn, message in [(summed, "holds the sum over ranks"), (local, "returned only its own data"),
                        (stub, "Task 0.1 is not done yet"), (nothing, "returned None"),
                        (lambda x: x, "has no source lablib can read")]:
        with pytest.raises(CheckFailed, match=message):
            check_mean_across_ranks(fn, cluster)
