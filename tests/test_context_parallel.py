"""Context parallelism (lab 06's library, before its notebook): one block's attention and the online-softmax
merge against single-process SDPA, ring attention forward and backward and the all-to-all (Ulysses)
attention on real Gloo ranks, contiguous and zig-zag, causal and not, and the work each layout gives a rank."""
import pytest
import torch
import torch.distributed as dist

import lablib
from lablib import comm
from lablib.answers import lab06 as cp
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
    pos = lablib.to_device(positions(layout, r, n, SHAPE[2]))
    mine = [t[..., pos, :].contiguous() for t in (q, k, v)]
    (out, lse), ops = comm.watched(cp.ring_attention, *mine, pos, causal)
    grads = None
    if backward:
        dout = lablib.to_device(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)))[..., pos, :]
        grads = cp.ring_attention_backward(*mine, pos, out, lse, dout.contiguous(), causal)
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
        assert r["ops"] == [f"send {2 * chunk}", f"recv {2 * chunk}"] * (n - 1)


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
