"""Lab 06 (context parallelism): one block's attention and the online-softmax merge against single-process
SDPA, ring attention forward and backward and the all-to-all (Ulysses) attention on real Gloo ranks,
contiguous and zig-zag, causal and not, the work each layout gives a rank, and Tasks 6.1-6.5's checks on
right answers and typical mistakes."""
import math

import pytest
from types import SimpleNamespace
import torch
import torch.distributed as dist

import lablib
from lablib import comm
from lablib.answers import lab06 as cp
from lablib.checks import CheckFailed
from lablib.checks.lab06 import check_blockwise, check_ring, check_ring_backward, check_ulysses, check_zigzag
from lablib.strategies.context_parallel import attend, positions, qkv, reference, work_per_rank

TOL = 1e-5
SHAPE = (2, 4, 32, 8)  # B, H, T, D: T divides into 2P chunks at P = 2 and 4, H into P heads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [32, 8, 5])
def test_blockwise_attention_is_attention(causal, block):
    q, k, v = qkv(*SHAPE, seed=1)
    out, lse = cp.blockwise_attention(q, k, v, block, causal)
    assert (out - reference(q, k, v, causal)).abs().max() < TOL
    scores = q @ k.transpose(-2, -1) / SHAPE[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(SHAPE[2], SHAPE[2], dtype=torch.bool).triu(1), float("-inf"))
    assert (lse - torch.logsumexp(scores, -1)).abs().max() < TOL


def test_a_row_that_sees_no_key_stays_zeros_through_the_merge():
    q, k, v = qkv(1, 1, 4, 8)
    late = torch.arange(4, 8)  # keys after every query: a causal row sees none of them
    out, lse = attend(q, k, v, torch.arange(4), late, causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    both, both_lse = cp.merge(out, lse, out, lse)
    assert not both.isnan().any() and torch.equal(both, torch.zeros_like(both)) and torch.isinf(both_lse).all()
    mine, mine_lse = attend(q, k, v, torch.arange(4), torch.arange(4), causal=True)
    merged, merged_lse = cp.merge(out, lse, mine, mine_lse)  # nothing plus something is the something
    assert torch.allclose(merged, mine) and torch.allclose(merged_lse, mine_lse)


def _ring_job(layout, causal, backward):
    r, n = dist.get_rank(), dist.get_world_size()
    q, k, v = lablib.to_device(*qkv(*SHAPE, seed=2))
    every = [lablib.to_device(positions(layout, s, n, SHAPE[2])) for s in range(n)]
    pos = every[r]
    mine = [t[..., pos, :].contiguous() for t in (q, k, v)]
    (out, lse), ops = comm.watched(cp.ring_attention, *mine, every, causal)
    grads = None
    if backward:
        dout = lablib.to_device(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)))[..., pos, :]
        grads = cp.ring_attention_backward(*mine, every, out, lse, dout.contiguous(), causal)
    return {"pos": pos, "out": out, "grads": grads, "ops": ops}


def _whole(results, key, index=None):
    """Every rank's part put back in sequence order."""
    parts = [r[key] if index is None else r[key][index] for r in results]
    whole = torch.empty(parts[0].shape[:-2] + (SHAPE[2], parts[0].shape[-1]))
    for r, part in zip(results, parts):
        whole[..., r["pos"], :] = part
    return whole


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_forward_and_backward_match_single_process_sdpa(cluster, layout, causal):
    results = cluster.run(_ring_job, layout, causal, True)
    q, k, v = (t.requires_grad_() for t in qkv(*SHAPE, seed=2))
    want = reference(q, k, v, causal)
    want.backward(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)))
    assert (_whole(results, "out") - want.detach()).abs().max() < TOL
    for i, t in enumerate((q, k, v)):
        assert (_whole(results, "grads", i) - t.grad).abs().max() < 1e-4, ("dq", "dk", "dv")[i]
    n, chunk = cluster.world_size, SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] // cluster.world_size * 4
    for r in results:  # K and V travel as one message per hop, n - 1 hops: no gather of the whole sequence
        assert r["ops"] == [f"recv {2 * chunk}", f"send {2 * chunk}"] * (n - 1)


def _allgather_job(layout, causal):
    from lablib.strategies.context_parallel import allgather_attention

    r, n = dist.get_rank(), dist.get_world_size()
    q, k, v = lablib.to_device(*qkv(*SHAPE, seed=5))
    every = [lablib.to_device(positions(layout, s, n, SHAPE[2])) for s in range(n)]
    (out, lse), ops = comm.watched(allgather_attention, *[t[..., every[r], :].contiguous() for t in (q, k, v)],
                                   every, causal)
    return {"pos": every[r], "out": out, "lse": lse, "ops": ops}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_allgather_attention_llama3s_matches_single_process_sdpa(cluster, layout, causal):
    results = cluster.run(_allgather_job, layout, causal)
    q, k, v = qkv(*SHAPE, seed=5)
    assert (_whole(results, "out") - reference(q, k, v, causal)).abs().max() < TOL
    chunk = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] // cluster.world_size * 4
    for r in results:  # one all-gather of this rank's K and V, nothing else
        assert r["ops"] == [f"all_gather {2 * chunk}"]


def test_allgather_sends_the_rings_bytes_and_holds_p_chunks():
    from lablib.strategies.context_parallel import kv_held, ring_bytes

    for n in (2, 4, 8):
        sent, held = ring_bytes(1024, 8, 32, n), kv_held(1024, 8, 32, n)
        assert sent["all-gather"] == sent["ring"] == 2 * (n - 1) * 1024 // n * 8 * 32 * 4
        assert held["all-gather"] == n * held["all-to-all"] == n / 2 * held["ring"]


def test_zigzag_evens_out_causal_work():
    for n in (2, 4):
        contiguous, zigzag = work_per_rank("contiguous", n, 64), work_per_rank("zigzag", n, 64)
        assert sum(contiguous) == sum(zigzag) == 64 * 65 // 2
        assert len(set(zigzag)) == 1
        # rank P-1 against rank 0: (2P-1) times, up to the diagonal blocks' halves
        assert contiguous[-1] / contiguous[0] == pytest.approx(2 * n - 1, rel=0.25)


def test_zigzag_shard_holds_the_layouts_positions():
    x = torch.arange(32).view(1, 1, 32, 1)
    for n in (2, 4):
        for r in range(n):
            assert torch.equal(cp.zigzag_shard(x, r, n).flatten(), positions("zigzag", r, n, 32))


def _ulysses_job(causal):
    r, n = dist.get_rank(), dist.get_world_size()
    q, k, v = lablib.to_device(*qkv(*SHAPE, seed=4))
    mine = [t.chunk(n, -2)[r].contiguous() for t in (q, k, v)]
    return comm.watched(cp.ulysses_attention, *mine, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_matches_single_process_sdpa(cluster, causal):
    results = cluster.run(_ulysses_job, causal)
    want = reference(*qkv(*SHAPE, seed=4), causal)
    got = torch.cat([out for out, _ in results], dim=-2)
    assert (got - want).abs().max() < TOL
    assert all(ops == [f"all_to_all {t}"] * 4 for _, ops in results
               for t in [SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] // cluster.world_size * 4])


# -- the checks: right answers pass (lablib's, through collect and judge), typical mistakes are named ----------
def _judged(check, fns, pool=None, seed=None):
    n = pool.world_size if pool is not None else None
    return check.judge(check.collect(fns, pool, seed), n, seed)


def test_lablibs_answers_pass_every_check(cluster):
    for seed in (None, 1, 2, 3, 4, 5):  # grading draws the shapes from its seed: every one must work
        assert "exact" in _judged(check_blockwise, (cp.merge, cp.blockwise_attention), seed=seed)
    assert "2P-1-r" in _judged(check_zigzag, (cp.zigzag_shard,), seed=3)
    assert "hop" in _judged(check_ring, (cp.ring_attention,), cluster)
    assert "hop" in _judged(check_ring, (cp.ring_attention,), cluster, seed=6)
    assert "home" in _judged(check_ring_backward, (cp.ring_attention_backward,), cluster, seed=2)
    assert "all-to-all" in _judged(check_ulysses, (cp.ulysses_attention,), cluster)


def merge_summed(out, lse, block_out, block_lse):
    return out + block_out, torch.logaddexp(lse, block_lse)


def merge_nan(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


def merge(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def blockwise_local_positions(q, k, v, block, causal):
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for start in range(0, k.shape[-2], block):
        keys = k[..., start:start + block, :]
        local = torch.arange(keys.shape[-2])  # the block's own 0.., not its place in the sequence
        out, lse = merge(out, lse, *lablib.attend(q, keys, v[..., start:start + block, :],
                                                  torch.arange(q.shape[-2]), local, causal))
    return out, lse


def blockwise_at_once(q, k, v, block, causal):
    pos = torch.arange(q.shape[-2])
    return lablib.attend(q, k, v, pos, pos, causal)


def test_blockwise_mistakes_are_named():
    with pytest.raises(CheckFailed, match="It looks like out \\+ block_out"):
        check_blockwise(merge_summed, cp_blockwise_learner)
    with pytest.raises(CheckFailed, match="gave NaN for rows that saw no key"):
        check_blockwise(merge_nan, cp_blockwise_learner)
    with pytest.raises(CheckFailed, match="positions in the whole sequence"):
        check_blockwise(merge, blockwise_local_positions)
    with pytest.raises(CheckFailed, match="called attend\\(\\) on blocks"):
        check_blockwise(merge, blockwise_at_once)


def cp_blockwise_learner(q, k, v, block, causal):
    pos = torch.arange(q.shape[-2])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for start in range(0, k.shape[-2], block):
        out, lse = merge(out, lse, *lablib.attend(q, k[..., start:start + block, :], v[..., start:start + block, :],
                                                  pos, pos[start:start + block], causal))
    return out, lse


def ring_to_everyone(q, k, v, positions, causal):
    rank, n = dist.get_rank(), dist.get_world_size()
    out, lse = lablib.attend(q, k, v, positions[rank], positions[rank], causal)
    chunks = {rank: torch.stack([k, v])}
    works = []
    for other in range(n):
        if other != rank:
            chunks[other] = torch.empty_like(chunks[rank])
            works += [lablib.exchange(sends=[(chunks[rank], other)], recvs=[(chunks[other], other)])]
    for w in works:
        w.wait()
    for other in range(n):
        if other != rank:
            out, lse = merge(out, lse, *lablib.attend(q, chunks[other][0], chunks[other][1], positions[rank],
                                                      positions[other], causal))
    return out, lse


def ring_own_positions(q, k, v, positions, causal):
    rank, n = dist.get_rank(), dist.get_world_size()
    held = torch.stack([k, v])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(n):
        out, lse = merge(out, lse, *lablib.attend(q, held[0], held[1], positions[rank], positions[rank], causal))
        if step < n - 1:
            incoming = torch.empty_like(held)
            works = [lablib.exchange(sends=[(held, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])]
            for w in works:
                w.wait()
            held = incoming
    return out, lse


def ring_gathered(q, k, v, positions, causal):
    n = dist.get_world_size()
    ks = torch.empty((n,) + k.shape)
    lablib.all_gather(ks, k)
    return q, q


def _ring(q, k, v, positions, causal, grouped=True, wait=True):
    """The ring forward with a mistake: ``grouped=False`` posts each hop's send and receive apart (fine on
    Gloo, a deadlock under NCCL); ``wait=False`` uses the new chunk without waiting for it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    held = torch.stack([k, v])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming = torch.empty_like(held)
            works = ([lablib.exchange(sends=[(held, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])] if grouped
                     else [lablib.isend(held, (rank + 1) % n), lablib.irecv(incoming, (rank - 1) % n)])
        out, lse = merge(out, lse, *lablib.attend(q, held[0], held[1], positions[rank], positions[src], causal))
        if step < n - 1:
            for w in works if wait else ():
                w.wait()
            held = incoming
    return out, lse


def ring_ungrouped(q, k, v, positions, causal):
    return _ring(q, k, v, positions, causal, grouped=False)


def backward_ungrouped(*args):
    return _ring_backward(*args, probs=_final_lse, grouped=False)


def test_a_hop_posted_ungrouped_deadlocks_under_nccls_rules_and_passes_on_gloo_alone(fragile, monkeypatch):
    from lablib import p2p

    for check, fn in ((check_ring, ring_ungrouped), (check_ring_backward, backward_ungrouped)):
        with pytest.raises(CheckFailed, match=r"(?s)Likely: a hop's send and receive were posted apart.*lablib.exchange"
                                              r".*\(NCCL's rules\): rank \d waits to send to rank \d"):
            check(fn, fragile)
    monkeypatch.setattr(p2p, "CHECKS", False)
    check_ring(ring_ungrouped, fragile)
    check_ring_backward(backward_ungrouped, fragile)


def test_ring_mistakes_are_named(cluster):
    if cluster.world_size > 2:  # with 2 ranks, the next rank is every other rank
        with pytest.raises(CheckFailed, match="each rank sends only to the next"):
            check_ring(ring_to_everyone, cluster)
    with pytest.raises(CheckFailed, match="positions\\[src\\]"):
        check_ring(ring_own_positions, cluster)
    with pytest.raises(CheckFailed, match="point-to-point"):
        check_ring(ring_gathered, cluster)


def _ring_backward(q, k, v, positions, out, lse, grad_out, causal, probs, home=True, grouped=True):
    """Task 6.3's backward with a mistake: ``probs(scores, lse)`` the block's probabilities; ``home=False``
    sends the gradients on only between blocks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pos, scale = positions[rank], 1 / math.sqrt(q.shape[-1])
    delta = (grad_out * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
    for step in range(n):
        src = (rank - step) % n
        kk, vv, dk, dv = travelling
        scores = q @ kk.transpose(-2, -1) * scale
        if causal:
            scores = scores.masked_fill(positions[src][None, :] > pos[:, None], float("-inf"))
        p = probs(scores, lse)
        dv += p.transpose(-2, -1) @ grad_out
        ds = p * (grad_out @ vv.transpose(-2, -1) - delta)
        dq += ds @ kk * scale
        dk += ds.transpose(-2, -1) @ q * scale
        if home or step < n - 1:
            incoming = torch.empty_like(travelling)
            works = ([lablib.exchange(sends=[(travelling, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])]
                     if grouped else [lablib.isend(travelling, (rank + 1) % n), lablib.irecv(incoming, (rank - 1) % n)])
            for w in works:
                w.wait()
            travelling = incoming
    return dq, travelling[2], travelling[3]


def _final_lse(scores, lse):
    return torch.exp(scores - lse[..., None])


def backward_not_home(*args):
    """Sends the gradients on only between blocks, so they end one rank short of home."""
    return _ring_backward(*args, probs=_final_lse, home=False)


def test_gradients_that_never_get_home_are_named(cluster):
    with pytest.raises(CheckFailed, match="dk differs from SDPA's gradient.*travel round the ring"):
        check_ring_backward(backward_not_home, cluster)


def zigzag_reversed(x, rank, world_size):
    chunks = x.chunk(2 * world_size, -2)
    return torch.cat([chunks[2 * world_size - 1 - rank], chunks[rank]], -2)


def ulysses_heads_first(q, k, v, causal):
    n = dist.get_world_size()
    B, H, t, D = q.shape

    def swap(x):  # chunk j holds heads for rank j, but cut along the wrong dimension
        send = x.reshape(B, H, n, t // n, D).permute(2, 0, 1, 3, 4).contiguous()
        got = torch.empty_like(send)
        lablib.all_to_all(got, send)
        return got.transpose(0, 1).reshape(B, H, t, D)

    pos = torch.arange(t)
    out, _ = lablib.attend(swap(q), swap(k), swap(v), pos, pos, causal)
    return swap(out)


def test_zigzag_and_ulysses_mistakes_are_named(cluster):
    with pytest.raises(CheckFailed, match="the other way round: rank r takes chunks r and"):
        check_zigzag(zigzag_reversed)
    with pytest.raises(CheckFailed, match="Task 6.5: .*differs from SDPA.*attended with q of shape .*cut the heads"):
        check_ulysses(ulysses_heads_first, cluster)


def ring_recv_late(q, k, v, positions, causal):
    """Computes each block, then exchanges the chunk: nothing travels under the compute."""
    rank, n = dist.get_rank(), dist.get_world_size()
    held = torch.stack([k, v])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(n):
        src = (rank - step) % n
        out, lse = merge(out, lse, *lablib.attend(q, held[0], held[1], positions[rank], positions[src], causal))
        if step < n - 1:
            incoming = torch.empty_like(held)
            works = [lablib.exchange(sends=[(held, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])]
            for w in works:
                w.wait()
            held = incoming
    return out, lse


def test_a_receive_posted_after_the_compute_is_named(cluster):
    with pytest.raises(CheckFailed, match="no receive posted"):
        check_ring(ring_recv_late, cluster)


# -- sends and receives over a simulated link: the ring's overlap picture on a CPU ------------------------------
SLOW = comm.Link("test link", 1e-3, 100e6)  # 1 ms + 10 ms a megabyte


def _exchange():
    r = dist.get_rank()
    x, got = torch.full((250_000,), float(r)), torch.empty(250_000)  # 1 MB each way
    dist.barrier()
    with comm.simulated(SLOW):
        works = [lablib.exchange(sends=[(x, 1 - r)], recvs=[(got, 1 - r)])]
        for w in works:
            w.wait()
        dist.barrier()
        if r == 0:
            lablib.send(x, 1)
            lablib.recv(got, 1)
        else:
            lablib.recv(got, 0)
            lablib.send(x, 0)
    return got[0].item()


def test_messages_over_a_simulated_link_take_the_modelled_time_and_deliver_the_data():
    with lablib.Cluster(2, quiet=True, timeout=20) as c:
        assert c.run(_exchange) == [1.0, 0.0]
        spans = c.timeline().spans
    model = SLOW.alpha + 1e6 / SLOW.beta  # 11 ms
    sends = [s for s in spans if s.meta.get("op") == "send"]
    assert len(sends) == 4 and all(s.meta["simulated"] == "test link" for s in sends)
    for s in sends:  # a send ends when its message arrives: the link's time, whatever the real transfer took
        assert s.end - s.start == pytest.approx(model, abs=2e-3)
    for s in (s for s in spans if s.meta.get("op") == "recv"):  # a recv ends at that arrival, never before
        assert s.end - s.start <= model + 10e-3  # (a loaded machine wakes a sleeping rank late)
    ping, pong = sorted((s for s in sends if not s.meta.get("async")), key=lambda s: s.start)[-2:]
    assert pong.start >= ping.end - 1e-3  # the blocking pong starts once the ping has arrived


def test_the_ring_runs_over_a_simulated_link(cluster):
    from lablib.strategies.context_parallel import ring_job

    link, n = comm.LINKS["10GbE"], cluster.world_size
    cluster.run(ring_job, cp.ring_attention, "contiguous", False, 1, False, link, tokens=512)
    sends = [s for s in cluster.timeline().spans if s.meta.get("op") == "send"]
    assert len(sends) == n * (n - 1) and all(s.meta.get("simulated") == link.name for s in sends)
    chunk = 2 * 8 * 512 // n * 32 * 4  # K and V of a rank's 512/n tokens, 8 heads of 32, fp32
    for s in sends:  # each hop takes the link's time for one chunk, whatever the real transfer took
        assert s.end - s.start >= link.alpha + chunk / link.beta - 1e-4


def ring_then_all_at_once(q, k, v, positions, causal):
    """A real ring that only collects the chunks, then one attention over all of them."""
    rank, n = dist.get_rank(), dist.get_world_size()
    held, kept = torch.stack([k, v]), {rank: torch.stack([k, v])}
    for step in range(1, n):
        incoming = torch.empty_like(held)
        works = [lablib.exchange(sends=[(held, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])]
        for w in works:
            w.wait()
        held = kept[(rank - step) % n] = incoming
    order = sorted(kept)
    keys = torch.cat([kept[s][0] for s in order], -2)
    values = torch.cat([kept[s][1] for s in order], -2)
    return lablib.attend(q, keys, values, positions[rank], torch.cat([positions[s] for s in order]), causal)


def ulysses_batch_mixed(q, k, v, causal):
    """The first all-to-all right; coming back, the rank and batch dimensions are left swapped."""
    n = dist.get_world_size()
    B, H, t, D = q.shape

    def to_heads(x):
        send = x.reshape(B, n, H // n, t, D).transpose(0, 1).contiguous()
        got = torch.empty_like(send)
        lablib.all_to_all(got, send)
        return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, D)

    pos = torch.arange(t * n)
    out, _ = lablib.attend(to_heads(q), to_heads(k), to_heads(v), pos, pos, causal)
    send = out.reshape(B, H // n, n, t, D).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    lablib.all_to_all(got, send)
    return got.reshape(B, H, t, D)  # should be got.transpose(0, 1).reshape(...)


def test_a_ring_that_attends_to_everything_at_once_and_a_batch_mixed_up_are_named(cluster):
    with pytest.raises(CheckFailed, match="one call per chunk"):
        check_ring(ring_then_all_at_once, cluster)
    with pytest.raises(CheckFailed, match="Task 6.5: .*differs from SDPA.*coming back, rank 0's output mixes batch "
                                          "elements.*transpose\\(0, 1\\)"):
        check_ulysses(ulysses_batch_mixed, cluster)


def merge_no_last_dim(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - safe) + block_out * torch.exp(block_lse - safe), new


def blockwise_from_zero(q, k, v, block, causal):
    pos = torch.arange(q.shape[-2])
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1])
    for start in range(0, k.shape[-2], block):
        out, lse = merge(out, lse, *lablib.attend(q, k[..., start:start + block, :], v[..., start:start + block, :],
                                                  pos, pos[start:start + block], causal))
    return out, lse


def test_a_merge_without_the_last_dimension_and_an_lse_starting_at_zero_are_named():
    with pytest.raises(CheckFailed, match="add a last dimension"):
        check_blockwise(merge_no_last_dim, cp_blockwise_learner)
    with pytest.raises(CheckFailed, match="lse at -inf"):
        check_blockwise(merge, blockwise_from_zero)


# -- the mistakes each check names: a learner's wrong function, run through the check ------------------------------
def ring_without_wait(q, k, v, positions, causal):
    """Posts each hop and uses the new chunk without waiting for it."""
    return _ring(q, k, v, positions, causal, wait=False)


def ring_waiting_at_the_end(q, k, v, positions, causal):
    """Waits for every handle, but only after the loop: each chunk is attended to before it has arrived."""
    rank, n = dist.get_rank(), dist.get_world_size()
    held, works = torch.stack([k, v]), []
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming = torch.empty_like(held)
            works += [lablib.exchange(sends=[(held, (rank + 1) % n)], recvs=[(incoming, (rank - 1) % n)])]
        out, lse = merge(out, lse, *lablib.attend(q, held[0], held[1], positions[rank], positions[src], causal))
        if step < n - 1:
            held = incoming
    for w in works:
        w.wait()
    return out, lse


def test_a_chunk_used_before_it_arrived_is_named(cluster):
    with pytest.raises(CheckFailed, match="never called wait\\(\\) on .*irecv.*An irecv only posts the receive"):
        check_ring(ring_without_wait, cluster)
    with pytest.raises(CheckFailed, match="receive\\(s\\) posted and not yet waited for.*read before it had arrived"):
        check_ring(ring_waiting_at_the_end, cluster)


def backward_per_block_softmax(*args):
    """Normalises each block's probabilities by its own softmax instead of the forward's final lse."""
    return _ring_backward(*args, probs=lambda scores, lse: torch.softmax(scores, -1))


def test_a_per_block_softmax_in_the_backward_is_named(cluster):
    with pytest.raises(CheckFailed, match="probabilities normalised per block.*the forward's final lse"):
        check_ring_backward(backward_per_block_softmax, cluster)


def zigzag_one_past(x, rank, world_size):
    chunks = x.chunk(2 * world_size, -2)
    return torch.cat([chunks[rank], chunks[2 * world_size - rank]], -2)


def zigzag_one_short(x, rank, world_size):
    chunks = x.chunk(2 * world_size, -2)
    return torch.cat([chunks[rank], chunks[2 * world_size - 2 - rank]], -2)


def zigzag_default_dim(x, rank, world_size):
    chunks = x.chunk(2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def zigzag_joined_on_dim_0(x, rank, world_size):
    chunks = x.chunk(2 * world_size, -2)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def test_zigzag_off_by_one_and_the_wrong_dimension_are_named():
    with pytest.raises(CheckFailed, match="took chunks r and 4 - r \\(rank 0 raised IndexError.*no chunk 4\\): off by one"):
        check_zigzag(zigzag_one_past)
    with pytest.raises(CheckFailed, match="took chunks r and 2 - r: off by one.*numbered 0 to 3"):
        check_zigzag(zigzag_one_short)
    with pytest.raises(CheckFailed, match="you cut dim 0 of x, not the sequence"):
        check_zigzag(zigzag_default_dim)
    with pytest.raises(CheckFailed, match="joined the two chunks along dim 0 \\(torch.cat's default\\)"):
        check_zigzag(zigzag_joined_on_dim_0)


def _ulysses(send_layout, arrive):
    """A Ulysses attention whose first all-to-all sends ``send_layout(x, P)`` and undoes it with
    ``arrive(got, B, H/P, T, D)``; the way back is right."""
    def attention(q, k, v, causal):
        n = dist.get_world_size()
        B, H, t, D = q.shape

        def to_heads(x):
            send = send_layout(x, n).contiguous()
            got = torch.empty_like(send)
            lablib.all_to_all(got, send)
            return arrive(got, B, H // n, n * t, D)

        pos = torch.arange(t * n)
        out, _ = lablib.attend(to_heads(q), to_heads(k), to_heads(v), pos, pos, causal)
        send = out.reshape(B, H // n, n, t, D).permute(2, 0, 1, 3, 4).contiguous()
        got = torch.empty_like(send)
        lablib.all_to_all(got, send)
        return got.transpose(0, 1).reshape(B, H, t, D)
    return attention


def right_send(x, n):
    B, H, t, D = x.shape
    return x.reshape(B, n, H // n, t, D).transpose(0, 1)


def right_arrival(got, B, h, T, D):
    return got.permute(1, 2, 0, 3, 4).reshape(B, h, T, D)


def no_transpose(x, n):  # the destination is not dim 0: all_to_all cuts the batch
    B, H, t, D = x.shape
    return x.reshape(B, n, H // n, t, D)


def reshape_only(x, n):  # a reshape to (P, B, ...) regroups memory, it moves no dimension
    B, H, t, D = x.shape
    return x.reshape(n, B, H // n, t, D)


def interleaved(x, n):  # head i to rank i % P, while the way back expects rank j's heads j*H/P..
    B, H, t, D = x.shape
    return x.reshape(B, H // n, n, t, D).permute(2, 0, 1, 3, 4)


def reshape_on_arrival(got, B, h, T, D):  # (P, B, H/P, T/P, D) read as if P were next to the tokens
    return got.reshape(B, h, T, D)


def ulysses_heads_back_interleaved(q, k, v, causal):
    """The first all-to-all right; coming back, the P chunks are put between the heads, not before them."""
    n = dist.get_world_size()
    B, H, t, D = q.shape
    pos = torch.arange(t * n)

    def heads(x):
        send = right_send(x, n).contiguous()
        got = torch.empty_like(send)
        lablib.all_to_all(got, send)
        return right_arrival(got, B, H // n, n * t, D)

    out, _ = lablib.attend(heads(q), heads(k), heads(v), pos, pos, causal)
    send = out.reshape(B, H // n, n, t, D).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    lablib.all_to_all(got, send)
    return got.permute(1, 2, 0, 3, 4).reshape(B, H, t, D)


def ulysses_no_transpose(q, k, v, causal):
    return _ulysses(no_transpose, right_arrival)(q, k, v, causal)


def ulysses_reshape_only(q, k, v, causal):
    return _ulysses(reshape_only, right_arrival)(q, k, v, causal)


def ulysses_interleaved(q, k, v, causal):
    return _ulysses(interleaved, right_arrival)(q, k, v, causal)


def ulysses_reshape_on_arrival(q, k, v, causal):
    return _ulysses(right_send, reshape_on_arrival)(q, k, v, causal)


def test_ulysses_layout_mistakes_are_told_apart(cluster):
    assert "all-to-all" in _judged(check_ulysses, (_ulysses(right_send, right_arrival),), cluster)  # right, it passes
    destination = ("attended to batch element\\(s\\).*dim 0 must be the destination" if cluster.world_size == 2 else
                   "has 2 rows in dim 0, which it cuts into one chunk per rank \\(4\\): dim 0 must be the destination")
    with pytest.raises(CheckFailed, match=destination):  # at 4 ranks the batch of 2 does not cut into 4
        check_ulysses(ulysses_no_transpose, cluster)
    with pytest.raises(CheckFailed, match="attended to batch element\\(s\\).*a reshape straight to \\(P, B, ...\\)"):
        check_ulysses(ulysses_reshape_only, cluster)
    with pytest.raises(CheckFailed, match="undone the wrong way on arrival.*permute\\(1, 2, 0, 3, 4\\)"):
        check_ulysses(ulysses_reshape_on_arrival, cluster)
    with pytest.raises(CheckFailed, match="attended to heads \\[0, .*dealt out interleaved"):
        check_ulysses(ulysses_interleaved, cluster)
    with pytest.raises(CheckFailed, match="coming back, rank 0's heads are in the order \\[0, [3-9]"):
        check_ulysses(ulysses_heads_back_interleaved, cluster)


# -- the notebook's numbers: each printed figure is the run drawn beside it, each formula its stated count ---------
def test_the_three_ways_send_their_formulas_and_only_the_ring_can_hide(cluster):
    from lablib.strategies.context_parallel import three_ways

    rows = {r["way"]: r for r in three_ways(cluster, cp.ring_attention, cp.ulysses_attention, tokens=256)}
    assert set(rows) == {"ring", "all-to-all", "all-gather"}
    for r in rows.values():  # measured from the timeline, against the formula
        assert r["sent"] == pytest.approx(r["formula"])
    n = cluster.world_size
    assert rows["all-gather"]["held"] == n * rows["all-to-all"]["held"] == n / 2 * rows["ring"]["held"]
    assert rows["all-to-all"]["hidden"] == rows["all-gather"]["hidden"] == 0  # attention waits for a blocking collective


def test_the_drawn_zigzag_step_is_the_run_whose_results_and_time_are_shown(cluster):
    from lablib.strategies.context_parallel import median_run

    results, timeline, seconds = median_run(cluster, cp.ring_attention, "zigzag", True, tokens=256)
    n = cluster.world_size
    assert seconds == max(r["seconds"][0] for r in results)  # the results shown are that run's
    assert all(0 < r["attention_median"] and r["attention"] <= r["cpu"] for r in results)
    sends = [s for s in timeline.spans if s.meta.get("op") == "send"]
    assert len(sends) == n * (n - 1)  # one step drawn: every rank's P - 1 hops, once


def test_the_notebooks_lines_name_their_backend_and_numbers(cluster):
    from lablib.strategies.context_parallel import LLAMA3_405B, gqa_allgather, modelled_activations
    from lablib.views import context_parallel as view

    assert view.measured(cluster) == "measured, Gloo"
    assert view.spread({"contiguous": ([1, 7], [0.01, 0.03]), "zigzag": ([4, 4], [0.02, 0.025])}).endswith(
        "contiguous: work 7.0x, CPU time 3.0x; zigzag: work 1.0x, CPU time 1.2x")
    gpu = SimpleNamespace(device="cuda", backend="nccl")  # what a label says of a run on GPUs
    assert view.spread({"zigzag": ([4, 4], [0.02, 0.025])}, gpu).endswith("zigzag: work 1.0x, GPU time 1.2x")
    assert "GPU time in attention" in view.work_figure({"zigzag": ([4, 4], [0.02, 0.025])}, gpu).layout.annotations[1].text
    line = view.sends([0.002, 0.010, 0.004], cluster)
    assert "took 4.0 ms, the median of the 3 sends" in line and "(2.0 to 10.0 ms; measured, Gloo" in line
    m = gqa_allgather(**LLAMA3_405B)  # 15/16 x 2 x 131072 x 8 x 128 x 2 bytes; 2 x 131072² x 128 x 128 / 16 FLOPs
    assert m["bytes"] == pytest.approx(503.3e6, rel=1e-3) and m["flops"] == pytest.approx(35.18e12, rel=1e-3)
    assert gqa_allgather(**{**LLAMA3_405B, "kv_heads": 128})["bytes"] == 16 * m["bytes"]
    assert modelled_activations(131072, 8) / 1e9 == pytest.approx(73.0, abs=0.1)  # 34 x 131072 x 4096 x 32 / 8


def test_the_memory_chart_pairs_each_p_in_one_hue_with_plain_log_ticks():
    from lablib.views.context_parallel import memory_figure

    rows = [{"P": p, "tokens": t, "saved": 2**20 * t / p, "kept": 2**14 * t / p} for p in (1, 2, 4) for t in (256, 1024)]
    fig = memory_figure(rows)
    hues = {}
    for trace in fig.data:
        hues.setdefault(trace.legendgroup, set()).add(trace.line.color)
    assert len(hues) == 3 and all(len(h) == 1 for h in hues.values())  # a P's two lines share one hue
    assert len({h for hs in hues.values() for h in hs}) == 3             # and the Ps differ
    assert fig.layout.yaxis.type == "log" and all("e" not in t for t in fig.layout.yaxis.ticktext)
