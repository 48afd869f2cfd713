"""The save snapshot's reusable host buffer (``SnapshotPool``): carving, claims, fallbacks, and
saves through a real service that use it. The CUDA side-stream copy is not exercised: no GPU here."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import ckptd_client.client as client_mod
from ckptd_client import CheckpointClient
from ckptd_client._pool import ALIGN, SnapshotPool
from ckptd_client._save import build_snapshot
from support import assert_bits_equal, blank_like, make_state

KIB = 1 << 10


def _slab(pool: SnapshotPool) -> torch.Tensor | None:
    """The slab when it is one allocated segment (without ``background``); else None."""
    segs = pool.segments
    return segs[0] if len(segs) == 1 else None


def _in_slab(pool: SnapshotPool, t: torch.Tensor) -> bool:
    assert _slab(pool) is not None
    return t.untyped_storage().data_ptr() == _slab(pool).untyped_storage().data_ptr()


# -- the pool alone ----------------------------------------------------------------------------------

def test_views_are_aligned_contiguous_disjoint_and_in_the_slab():
    pool = SnapshotPool(64 * KIB)
    assert not _slab(pool).is_pinned() or torch.cuda.is_available()
    assert int(_slab(pool).count_nonzero()) == 0  # pre-faulted by zeroing
    claim = pool.claim()
    specs = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((1,), torch.int64), ((2, 3, 1), torch.bool),
             ((33,), torch.uint8), ((4, 4), torch.float64)]
    views = [claim.take(shape, dtype) for shape, dtype in specs]
    for i, ((shape, dtype), v) in enumerate(zip(specs, views)):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous() and _in_slab(pool, v)
        assert v.data_ptr() % ALIGN == 0
        v.view(-1).view(torch.uint8).fill_(i + 1)
    for i, v in enumerate(views):  # no view overlaps another
        assert bool((v.view(-1).view(torch.uint8) == i + 1).all())
    assert pool.stats.pooled_bytes == sum(torch.Size(s).numel() * d.itemsize for s, d in specs)
    assert pool.stats.fallback_bytes == 0


def test_chunks_that_do_not_fit_get_fresh_memory_and_later_small_ones_still_fit():
    pool = SnapshotPool(1000)
    claim = pool.claim()
    a = claim.take((200,), torch.float32)    # 800 bytes, padded to 832
    b = claim.take((100,), torch.float32)    # 400 bytes: does not fit in what is left
    c = claim.take((40,), torch.float32)     # 160 bytes: fits after a
    assert _in_slab(pool, a) and not _in_slab(pool, b) and _in_slab(pool, c)
    assert (pool.stats.pooled_bytes, pool.stats.fallback_bytes) == (960, 400)


def test_one_lease_at_a_time_busy_falls_back_release_is_idempotent_and_waits_are_bounded():
    pool = SnapshotPool(4 * KIB)
    first = pool.claim()
    assert pool.claimed
    second = pool.claim()  # wait_s=0: busy at once
    assert not _in_slab(pool, second.take((10,), torch.float32))
    assert (pool.stats.claims, pool.stats.busy, pool.stats.fallback_bytes) == (1, 1, 40)
    second.release()
    assert pool.claimed  # a busy claim gives back nothing
    first.release()
    first.release()
    assert not pool.claimed
    third = pool.claim()
    assert _in_slab(pool, third.take((10,), torch.float32))
    threading.Timer(0.2, third.release).start()
    fourth = pool.claim(wait_s=10)  # woken by the release, not the timeout
    assert _in_slab(pool, fourth.take((10,), torch.float32)) and pool.stats.claims == 3
    fourth.release()


def test_closed_pool_serves_fresh_memory_and_drops_its_slab():
    pool = SnapshotPool(4 * KIB)
    slab = weakref.ref(_slab(pool))
    pool.close()
    gc.collect()
    assert pool.closed and slab() is None
    t = pool.claim().take((3,), torch.float32)
    assert t.shape == (3,) and pool.stats.busy == 0 and pool.stats.fallback_bytes == 12


def test_build_snapshot_copies_into_the_slab_and_release_gives_it_back():
    sd = make_state(3, mib=0.25)
    pool = SnapshotPool(1 << 20)
    snap = build_snapshot(sd, 0, 1, pool)
    datas = [c.data for cs in snap.chunks.values() for c in cs]
    assert len(datas) == 3 and all(_in_slab(pool, d) for d in datas) and pool.claimed
    sd["model"]["w"].add_(1)  # a copy: training may mutate right away
    assert not torch.equal(snap.chunks["model.w"][0].data, sd["model"]["w"])
    assert torch.equal(snap.chunks["model.w"][0].data + 1, sd["model"]["w"])
    snap.release()
    assert not pool.claimed and snap.chunks == {} and snap.claim is None


def test_a_failing_snapshot_gives_the_claim_back():
    pool = SnapshotPool(1 << 20)
    sd = {"w": torch.ones(10), "bad": lambda: None}  # not picklable: encoding the object raises
    with pytest.raises(Exception):
        build_snapshot(sd, 0, 1, pool)
    assert not pool.claimed


# -- saves through a real service ------------------------------------------------------------------------

@pytest.fixture
def gated_upload(monkeypatch):
    """Holds every background upload until the test sets the event (so "busy" is deterministic)."""
    gate = threading.Event()
    real = client_mod.upload_snapshot

    def held(*a, **kw):
        assert gate.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(client_mod, "upload_snapshot", held)
    yield gate
    gate.set()


def _load(client: CheckpointClient, ref: str, like: dict) -> dict:
    got = blank_like(like)
    client.load(got, ref)
    return got


def test_consecutive_saves_reuse_the_slab_and_round_trip(server):
    client = CheckpointClient(server.url, snapshot_bytes=2 << 20)
    pool = client.snapshot_pool
    assert pool is not None
    want = [make_state(s, mib=1) for s in (1, 2)]
    for i, sd in enumerate(want):
        client.save(sd, f"pool/{i + 1}").wait()
        assert not pool.claimed  # given back before wait() returned
    assert (pool.stats.claims, pool.stats.busy, pool.stats.fallback_bytes) == (2, 0, 0)
    for i, sd in enumerate(want):
        assert_bits_equal(_load(client, f"pool/{i + 1}", sd), sd)
    client.close()


def test_a_save_while_the_previous_uploads_uses_fresh_memory(server, gated_upload):
    client = CheckpointClient(server.url, snapshot_bytes=2 << 20)
    pool = client.snapshot_pool
    want = [make_state(s, mib=0.5) for s in (4, 5)]
    handles = [client.save(sd, f"busy/{i}") for i, sd in enumerate(want)]  # both before any upload ran
    assert (pool.stats.claims, pool.stats.busy) == (1, 1) and pool.stats.fallback_bytes > 0
    gated_upload.set()
    for h in handles:
        h.wait()
    assert not pool.claimed
    for i, sd in enumerate(want):
        assert_bits_equal(_load(client, f"busy/{i}", sd), sd)
    client.close()


def test_a_snapshot_bigger_than_the_pool_round_trips(server):
    client = CheckpointClient(server.url, snapshot_bytes=64 * KIB)
    pool = client.snapshot_pool
    sd = make_state(6, mib=0.5)  # w (512 KiB) does not fit; b and count do
    client.save(sd, "big/1").wait()
    assert pool.stats.fallback_bytes == sd["model"]["w"].numel() * 4 and pool.stats.pooled_bytes > 0
    assert_bits_equal(_load(client, "big/1", sd), sd)
    client.close()


def test_mutating_the_model_after_save_returns_does_not_change_the_checkpoint(server, gated_upload):
    client = CheckpointClient(server.url, snapshot_bytes=2 << 20)
    sd = make_state(7, mib=0.5)
    want = {k: ({n: t.clone() for n, t in v.items()} if k == "model" else v) for k, v in sd.items()}
    handle = client.save(sd, "mut/1")
    for t in sd["model"].values():  # the upload has not started: it can only read the snapshot
        t.fill_(3)
    gated_upload.set()
    handle.wait()
    assert_bits_equal(_load(client, "mut/1", want), want)
    client.close()


def test_close_releases_the_pool(server):
    client = CheckpointClient(server.url, snapshot_bytes=1 << 20)
    pool = client.snapshot_pool
    slab = weakref.ref(_slab(pool))
    client.save(make_state(8), "close/1")  # not waited: close() waits, then frees the slab
    client.close()
    gc.collect()
    assert pool.closed and not pool.claimed and slab() is None
    plain = CheckpointClient(server.url, snapshot_bytes=0)
    assert plain.snapshot_pool is None  # 0: nothing kept between saves
    plain.close()


def _copied(sd: dict) -> int:
    """The bytes one save of ``sd`` copies into the slab (one rank: every tensor, each aligned)."""
    return sum(t.numel() * t.element_size() + (-t.numel() * t.element_size()) % ALIGN
               for t in sd["model"].values())


def test_the_default_client_sizes_its_slab_from_the_save_and_follows_the_state(server):
    """No tuning argument: the first save allocates a slab of exactly what it copies, later saves
    of the same state reuse it (no allocation, nothing outside it); a larger state gets a larger
    slab, one under half of it a smaller one; a cap below the need leaves the rest to fresh memory."""
    client = CheckpointClient(server.url, incremental=False)  # full saves: every one copies everything
    pool = client.snapshot_pool
    assert pool is not None and pool.sized and _slab(pool) is None  # nothing held before a save
    small, large, tiny = make_state(11, mib=0.5), make_state(12, mib=1), make_state(13, mib=0.125)
    for i in range(3):
        client.save(small, f"auto/{i}").wait()
    assert pool.capacity == _copied(small) and pool.stats.allocations == 1
    assert (pool.stats.claims, pool.stats.fallback_bytes) == (3, 0)
    assert pool.stats.pooled_bytes == 3 * sum(t.numel() * t.element_size() for t in small["model"].values())
    client.save(large, "auto/large").wait()
    assert pool.capacity == _copied(large) and pool.stats.allocations == 2
    client.save(small, "auto/small-again").wait()  # over half of the slab: kept
    assert pool.capacity == _copied(large) and pool.stats.allocations == 2
    client.save(tiny, "auto/tiny").wait()  # under half: replaced by a smaller one
    assert pool.capacity == _copied(tiny) and pool.stats.allocations == 3 and pool.stats.fallback_bytes == 0
    for ref, sd in (("auto/2", small), ("auto/large", large), ("auto/tiny", tiny)):
        assert_bits_equal(_load(client, ref, sd), sd)
    slab = weakref.ref(_slab(pool))
    client.close()
    gc.collect()
    assert slab() is None

    capped = CheckpointClient(server.url, snapshot_max_bytes=64 * KIB, incremental=False)
    capped.save(small, "auto/capped").wait()
    pool = capped.snapshot_pool
    assert pool.capacity == 64 * KIB and pool.stats.fallback_bytes == small["model"]["w"].numel() * 4
    assert_bits_equal(_load(capped, "auto/capped", small), small)
    capped.close()


def test_the_snapshot_cap_follows_the_environment_and_the_local_ranks(monkeypatch):
    from ckptd_client._pool import default_max_bytes

    monkeypatch.setenv("CKPTD_SNAPSHOT_MAX_BYTES", str(3 << 20))
    assert default_max_bytes() == 3 << 20 and SnapshotPool().max_bytes == 3 << 20
    monkeypatch.delenv("CKPTD_SNAPSHOT_MAX_BYTES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_max_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_max_bytes() in (one // 8, one // 8 - 1) and 0 < one


def test_the_former_names_of_claims_and_claimed_still_read_with_a_deprecation_warning():
    from ckptd_client._pool import PoolStats

    stats = PoolStats(claims=3)
    with pytest.warns(DeprecationWarning, match="PoolStats.claims"):
        assert stats.leases == 3
    pool = SnapshotPool(1 << 12)
    claim = pool.claim(sizes=[1 << 12])
    with pytest.warns(DeprecationWarning, match="SnapshotPool.claimed"):
        assert pool.leased is pool.claimed is True
    claim.release()
    with pytest.warns(DeprecationWarning, match="SnapshotPool.claimed"):
        assert pool.leased is pool.claimed is False
    pool.close()
