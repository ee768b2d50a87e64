"""lablib's reference pieces on a sub-group of the ranks, as a device mesh composes them: on 4 ranks cut
2 x 2, each piece run on its axis's groups (two groups at once) gives what it gives alone on a world of 2
ranks, which the labs' own tests hold to one process: FSDP's units (labs 01 and 03), Megatron's f and g
(lab 04), the pipeline executor (lab 05), the all-to-all with split sizes (lab 07); and a collective over a
simulated link waits for its group only."""
import pytest
import torch
import torch.distributed as dist

import lablib
from lablib import comm
from lablib.answers import lab01, lab04, lab05
from lablib.strategies import flat, pipeline
from lablib.strategies.tp_reference import layers
from lablib.toy import seeded


def _groups():
    """This rank's group along each axis of the 2 x 2 mesh rank = 2·row + column: "row" holds ranks
    {0, 1} and {2, 3}, "column" {0, 2} and {1, 3}. Every rank makes every group, in the same order."""
    r = dist.get_rank()
    mine = {}
    for axis, members in (("row", ([0, 1], [2, 3])), ("column", ([0, 2], [1, 3]))):
        for ranks in members:
            group = dist.new_group(ranks)
            if r in ranks:
                mine[axis] = (group, ranks.index(r), ranks)
    return mine


def _tp_job(on_mesh: bool):
    """Megatron's MLP split over 2 ranks (a row of the mesh, or the whole world of 2), forward and backward
    on the input of the row (each row its own batch)."""
    group, index, _ = _groups()["row"] if on_mesh else (None, dist.get_rank(), None)
    row = dist.get_rank() // 2 if on_mesh else 0
    ff, _ = layers(0)
    w1, b1 = lab04.shard_column(ff.fc1.weight.detach(), ff.fc1.bias.detach(), index, 2)
    w2, b2 = lab04.shard_row(ff.fc2.weight.detach(), ff.fc2.bias.detach(), index, 2)
    with seeded(100 + row):
        x = torch.randn(3, 8, ff.fc1.in_features)
    x, w1, b1, w2 = (t.clone().requires_grad_() for t in lablib.to_device(x, w1, b1, w2))
    y = lab04.tp_mlp(x, w1, b1, w2, b2, group)
    y.sum().backward()
    return [y.detach(), x.grad, w1.grad, w2.grad]


def _pp_job(on_mesh: bool):
    """Lab 05's executor on a 2-stage pipeline (a column of the mesh, or the world of 2), 1F1B, 4
    micro-batches, each column its own batch: the gradients of this rank's stage."""
    group, index, _ = _groups()["column"] if on_mesh else (None, dist.get_rank(), None)
    batch = dist.get_rank() % 2 if on_mesh else 0
    blocks = list(lablib.to_device(pipeline.model(16, 4)))
    xs, ys = ([lablib.to_device(t) for t in ts] for ts in pipeline.data(16, 8, 4, seed=batch))
    stages = pipeline.stages_of(index, 2, 1, blocks, xs, ys)
    lab05.execute(stages, lab05.one_f_one_b(2, 4)[index], group)
    return [p.grad for s in stages.values() for b in s.blocks for p in b.parameters()]


def _fsdp_job(on_mesh: bool):
    """One ZeRO-3 step of a unit sharded over 2 ranks (a row, or the world of 2): its shard after the step and
    the gathered parameters."""
    group, index, _ = _groups()["row"] if on_mesh else (None, dist.get_rank(), None)
    with seeded(3):
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model = lablib.to_device(model)
    units = flat.setup(model, index, 2, lambda master: {}, frees_params=True, group=group)
    out = []
    for unit in units:
        lab01.unshard(unit, None)
        out.append(unit.flat.clone())
        lab01.reshard(unit)
    return out


@pytest.fixture(scope="module")
def four():
    with lablib.Cluster(4, backend="gloo", timeout=5, quiet=True) as c:
        yield c


@pytest.fixture(scope="module")
def two():
    with lablib.Cluster(2, backend="gloo", timeout=5, quiet=True) as c:
        yield c


def _same(a, b):
    return len(a) == len(b) and all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def test_tensor_parallel_on_each_row_equals_tensor_parallel_alone(four, two):
    alone, mesh = two.run(_tp_job, False), four.run(_tp_job, True)
    assert _same(mesh[0], alone[0]) and _same(mesh[1], alone[1])  # row 0 is the world of 2's batch
    assert not torch.allclose(mesh[2][0], mesh[0][0])  # row 1 had its own batch: its own all-reduces


def test_the_pipeline_on_each_column_equals_the_pipeline_alone(four, two):
    alone, mesh = two.run(_pp_job, False), four.run(_pp_job, True)
    assert _same(mesh[0], alone[0]) and _same(mesh[2], alone[1])  # column 0 (ranks 0, 2): stages 0 and 1
    assert not _same(mesh[1], mesh[0])  # column 1 had its own batch


def test_fsdp_units_gather_over_their_row(four, two):
    alone, mesh = two.run(_fsdp_job, False), four.run(_fsdp_job, True)
    assert all(_same(m, alone[0]) for m in mesh)  # every row gathers the same whole parameters


def _a2a_job():
    """In each column, member 0 sends its 1 row to member 1, member 1 one of its 2 rows to each."""
    group, index, _ = _groups()["column"]
    x = torch.full((index + 1, 2), float(dist.get_rank()))
    sizes = [index, 1]
    counts = torch.empty(2, dtype=torch.long)
    comm.all_to_all(counts, torch.tensor(sizes), group=group)
    out = torch.empty(int(counts.sum()), 2)
    comm.all_to_all(out, x, counts.tolist(), sizes, group=group)
    return out[:, 0].tolist()


def test_an_all_to_all_with_split_sizes_runs_within_its_group(four):
    assert four.run(_a2a_job) == [[2.0], [3.0], [0.0, 2.0], [1.0, 3.0]]


def _simulated_job():
    """Only the first row's ranks run a collective over the simulated link: the link's clock must not wait
    for ranks outside its group (which would never come)."""
    group, _, _ = _groups()["row"]
    t = torch.ones(1000)
    dist.barrier()
    with comm.simulated(comm.LINKS["1GbE"]):
        if dist.get_rank() < 2:
            comm.all_reduce(t, group=group)
    return t[0].item()


def test_a_collective_over_a_simulated_link_waits_for_its_group_only(four):
    assert four.run(_simulated_job) == [2.0, 2.0, 1.0, 1.0]


def _gather_job():
    from lablib.strategies.prefetch import start_recording

    group, _, _ = _groups()["row"]
    x = torch.ones(250)
    out = torch.empty(500)
    start_recording()
    comm.all_gather(out, x, group=group)


def test_a_sub_groups_collective_counts_the_bytes_of_its_group(four):
    four.run(_gather_job)
    # the ring over the row's 2 ranks: each sends its 1000 bytes once (over 4 ranks it would be 3 times)
    assert [comm.bytes_sent(four.timeline(), rank=r) for r in range(4)] == [1000.0] * 4


def _late_job():
    """Rank 0 comes 0.3 s late to its row's all-reduce; the other row runs two of its own meanwhile."""
    import time

    from lablib.strategies.prefetch import start_recording

    group, _, _ = _groups()["row"]
    t = torch.ones(10)
    dist.barrier()
    start_recording()
    if dist.get_rank() == 0:
        time.sleep(0.3)
    for _ in range(1 if dist.get_rank() < 2 else 2):
        comm.all_reduce(t, group=group)


def test_a_rank_waits_for_the_late_rank_of_its_own_group_only(four):
    four.run(_late_job)
    waiting = {r: row["waiting"] for r, row in four.timeline().summary().items()}
    assert waiting[1] > 0.1 and waiting[2] < 0.1 and waiting[3] < 0.1
