"""The GPU path: NCCL with one GPU per rank, CUDA tensors, spans placed where their kernels ran. Marked
``gpu``: they skip without CUDA and run with ``./lab.sh test -m gpu`` (or ``bash tests/gpu.sh``, which adds
profiler traces and bench items). With a single GPU NCCL runs at world size 1: the multi-rank NCCL paths need 2."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lablib import Cluster, Timeline, bandwidth

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]


def _all_reduce():
    import torch.distributed as dist

    import lablib

    x = torch.full((1 << 20,), float(dist.get_rank() + 1), device=lablib.device())
    lablib.all_reduce(x)
    return x.device.type, x[0].item()


def test_nccl_all_reduces_cuda_tensors_and_times_the_transfer():
    n = min(2, GPUS)
    with Cluster(n, backend="nccl", timeout=60, quiet=True) as c:
        assert c.run(_all_reduce) == [("cuda", n * (n + 1) / 2)] * n
        spans = [s for s in c.timeline().spans if s.kind == "comm"]
        assert len(spans) == n and all(s.duration > 0 for s in spans)


def _every_collective():
    """Each collective lablib wraps, as it waits and asynchronously, on this rank's device: what each left, and
    the timeline's comm spans."""
    import torch.distributed as dist

    import lablib

    n, r, dev = dist.get_world_size(), dist.get_rank(), lablib.device()
    x = torch.arange(4.0, device=dev) + 10 * r
    got = {}
    for wait in (True, False):
        run = (lambda work: None) if wait else (lambda work: work.wait())
        a = x.clone()
        run(lablib.all_reduce(a, async_op=not wait))
        m = x.clone()
        run(lablib.all_reduce(m, op=dist.ReduceOp.MAX, async_op=not wait))
        g = torch.empty(4 * n, device=dev)
        run(lablib.all_gather(g, x, async_op=not wait))
        s = torch.empty(4, device=dev)
        run(lablib.reduce_scatter(s, torch.arange(4.0 * n, device=dev) + r, async_op=not wait))
        b = x.clone()
        run(lablib.broadcast(b, 0, async_op=not wait))
        t = torch.empty(4 * n, device=dev)
        run(lablib.all_to_all(t, torch.arange(4.0 * n, device=dev) + 100 * r, async_op=not wait))
        u = torch.empty(4 * n, device=dev)  # uneven split sizes: rank r sends j + 1 rows to rank j
        sent = torch.arange(float(sum(j + 1 for j in range(n))), device=dev)
        run(lablib.all_to_all(u[:(r + 1) * n], sent, [r + 1] * n, [j + 1 for j in range(n)], async_op=not wait))
        left = dict(a=a, m=m, g=g, s=s, b=b, t=t, u=u[:(r + 1) * n])
        got[wait] = {k: (v.device.type, v.tolist()) for k, v in left.items()}
    lablib.barrier()
    return got


def _every_collective_wanted(n, r):
    x = [i + 10 * q for q in range(n) for i in range(4)]
    sent = [float(i) for i in range(sum(j + 1 for j in range(n)))]
    offsets = [sum(j + 1 for j in range(k)) for k in range(n)]
    return {"a": [sum(i + 10 * q for q in range(n)) for i in range(4)], "m": [i + 10 * (n - 1) for i in range(4)],
            "g": [float(v) for v in x], "s": [sum(4 * r + i + q for q in range(n)) for i in range(4)],
            "b": [float(i) for i in range(4)],
            "t": [4 * r + i + 100 * q for q in range(n) for i in range(4)],
            "u": [v for q in range(n) for v in sent[offsets[r]:offsets[r] + r + 1]]}


def test_every_collective_lablib_wraps_runs_on_nccl():
    """At world size 1 on one GPU (NCCL launches no kernel for one rank there: this holds lablib's path, not NCCL's
    transfers), at 2 with two GPUs: the results on the GPU, waited for or asynchronous, and a comm span for each."""
    n = min(2, GPUS)
    with Cluster(n, backend="nccl", timeout=60, quiet=True) as c:
        results = c.run(_every_collective)
        comm = [s for s in c.timeline().spans if s.kind == "comm"]
    for r, got in enumerate(results):
        for wait in (True, False):
            assert {k: v for k, (_, v) in got[wait].items()} == _every_collective_wanted(n, r), (r, wait, got[wait])
            assert {device for device, _ in got[wait].values()} == {"cuda"}
    assert len(comm) >= n * (2 * 7 + 1), comm  # 7 collectives twice, and the barrier


def _matmuls():
    import lablib

    x = torch.randn(2048, 2048, device=lablib.device())
    for i in range(3):
        with lablib.span(f"matmul {i}"):
            x = x @ x / 2048
    with lablib.span("on the host"):
        sum(range(1000))
    lablib.all_reduce(x)
    return x.sum().item()


def test_spans_are_placed_where_their_kernels_ran():
    """Each matmul span lasts its kernel's time on the GPU, after its launch and in launch order; a span that
    launched nothing keeps the host's clock; the lanes' labels say which."""
    with Cluster(1, backend="nccl", timeout=60, quiet=True) as c:
        c.run(_matmuls)
        timeline = c.timeline()
    spans = {s.name: s for s in timeline.spans}
    mms = [spans[f"matmul {i}"] for i in range(3)]
    assert all(s.meta["clock"] == "GPU kernels" and s.duration > 0 for s in mms), mms
    assert mms[0].end <= mms[1].start + 1e-6 and mms[1].end <= mms[2].start + 1e-6  # one stream: one after another
    assert spans["on the host"].meta["clock"] == "host"
    assert "GPU kernels" in " ".join(timeline.figure().layout.yaxis.ticktext)


def test_the_nccl_bandwidth_sweep_runs():
    n = min(2, GPUS)
    with Cluster(n, backend="nccl", timeout=60, quiet=True) as c:
        rows = bandwidth.sweep(c, [1 << 16, 1 << 22], iters=3)
    assert rows and all(r["busbw"] >= 0 for r in rows)


def test_torchrun_runs_a_lab_on_the_gpus(tmp_path):
    """With 2 GPUs, lab 02, whose checks all run at 2 ranks; on one GPU, where every rank check needs a peer and
    is skipped (so lablib.run exits 1), lab 01, whose first two checks need none."""
    n = min(2, GPUS)
    lab, said = ("collectives", "4 check(s) passed, 0 failed") if n == 2 else ("sharding", "2 check(s) passed, 3 ")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m",
                          "lablib.run", lab, "--trace", str(tmp_path / "t.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert f"{n} ranks (NCCL)" in out.stdout and said in out.stdout, out.stdout + out.stderr
    assert out.returncode == (0 if n == 2 else 1) and "✗" not in out.stdout, out.stdout + out.stderr
    assert Timeline.load(tmp_path / "t.json").world_size == n


def _where():
    import lablib

    return str(lablib.device())


def test_ranks_share_one_gpu_for_compute_and_talk_over_gloo(capsys):
    """More ranks than GPUs: each computes on a GPU (round-robin), lablib's collectives go over Gloo through
    host memory, and every lab's rank checks pass."""
    n = GPUS + 1
    with Cluster(n, timeout=60) as c:
        assert c.backend == "gloo" and c.device == "cuda"
        assert f"{n} ranks share {GPUS} GPU(s) for compute" in capsys.readouterr().out
        assert c.run(_where) == [f"cuda:{r % GPUS}" for r in range(n)]
        _every_check(c)


@pytest.mark.skipif(GPUS < 2, reason="NCCL at 2 ranks needs 2 GPUs")
def test_every_labs_rank_checks_pass_under_nccl_at_2_ranks():
    with Cluster(2, backend="nccl", timeout=60, quiet=True) as c:
        assert c.run(_where) == ["cuda:0", "cuda:1"]
        _every_check(c)


def _every_check(c):
    """Every lab's rank checks with lablib's answers on ``c``; a check of other sizes only (lab 08's 2×2 meshes)
    on a pool of its size: NCCL where there is a GPU per rank, else its ranks share the GPUs over Gloo."""
    from test_device import RANK_CHECKS, run_check

    for lab, check in RANK_CHECKS:
        if c.world_size in check.world_sizes:
            run_check(lab, check, c)
            continue
        with Cluster(check.world_sizes[0], timeout=60, quiet=True) as other:
            run_check(lab, check, other)
