"""The commit at scale: the streaming merge (``ManifestFold``, indexes read and folded rank by rank)
gives the manifest a merge of all indexes at once gives, refuses what it refused with the same
typed error, finds a complete session without listing every rank at every ``put_index``, and holds
the manifest plus a bounded window rather than every parsed index.

The reference manifest is built the plain way: every rank's chunks as objects, gathered per tensor
in order of first appearance, sorted by (rank, kind, offsets) in arrival order, through the
validating ``TensorEntry(chunks=...)`` and ``Manifest`` constructors.
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.storage.local import LocalStorage
from ckptd.store.paths import Paths, RankBatch, rank_batch
from ckptd.store.completeness import PROBES
from ckptd.store.rank_indexes import stored
from ckptd.store.events import AfterCommit
from ckptd.store.merge import merge_indexes
from ckptd.store.session_reads import read_meta
from ckptd.store.sessions import SessionStore
from ckptd.store.verification import strays_of, verify_committed
from ckptd_schemas import (
    BoxChunk, ChecksumMismatch, FileEntry, FlatChunk, InvalidIndex, Location, Manifest, ObjectEntry, OpenSession,
    ParamGroup, RankIndex, RankInfo, SessionConflict, SessionNotFound, StorageError, TensorEntry, TilingError, Topology,
)
from ckptd_schemas.arrival import Declared
from support import TIME_SCALE

try:
    from .staging import store_index
except ImportError:  # imported as a top-level module by the memory test's fresh interpreter
    from staging import store_index

CREATED = datetime(2026, 1, 2, tzinfo=timezone.utc)
BLOCK = 4096


# -- random layouts --------------------------------------------------------------------------------

@st.composite
def layouts(draw) -> tuple[int, list[RankIndex]]:
    """A valid save of 1-6 ranks: per tensor, row bands or flat ranges (some replicated on a second
    rank, some compressed), spread over random ranks; each rank lists its tensors in its own order
    (a tensor it holds no chunk of, maybe not at all), declares digests or not, and saves objects
    and param groups."""
    world = draw(st.integers(1, 6))
    pieces: dict[int, list[tuple]] = {r: [] for r in range(world)}
    meta: dict[str, tuple[list[int], str]] = {}
    for t in range(draw(st.integers(1, 4))):
        name, shape = f"model.t{t}", draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        meta[name] = (shape, dtype)
        flat = len(shape) == 1 and draw(st.booleans())
        cuts = sorted(set(draw(st.lists(st.integers(1, shape[0]), max_size=3))) - {shape[0]})
        for lo, hi in zip([0, *cuts], [*cuts, shape[0]]):
            nbytes = (hi - lo) * (shape[1] if len(shape) > 1 else 1) * (4 if dtype == "float32" else 2)
            codec = draw(st.sampled_from(["raw", "raw", "zstd"]))
            digest = f"{draw(st.integers(0, 2 ** 64 - 1)):016x}"
            for r in draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=2, unique=True)):  # replicas
                pieces[r].append((name, flat, lo, hi, nbytes, codec, digest))
    indexes = []
    for r in range(world):
        chunks: dict[str, list] = {n: [] for n in meta}
        offset = 0
        for name, flat, lo, hi, nbytes, codec, digest in draw(st.permutations(pieces[r])):
            shape = meta[name][0]
            loc = Location(file=f"r{r}.bin", offset=offset, length=nbytes if codec == "raw" else 3, codec=codec,
                           raw_length=nbytes, xxh3=digest)
            offset += loc.length
            chunks[name].append(FlatChunk(rank=r, start=lo, length=hi - lo, location=loc) if flat else BoxChunk(
                rank=r, offsets=[lo, *[0] * (len(shape) - 1)], sizes=[hi - lo, *shape[1:]], location=loc))
        names = [n for n in draw(st.permutations(sorted(meta))) if chunks[n] or draw(st.booleans())]
        tensors = [TensorEntry(name=n, shape=meta[n][0], dtype=meta[n][1], group="model",
                               digest="f" * 16 if draw(st.booleans()) else None, placement=f"p{r}",
                               chunks=chunks[n]) for n in names]
        objects = [ObjectEntry(name="rng", rank=r, encoding="json", value=draw(st.sampled_from([1, r]))),
                   ObjectEntry(name="cfg", encoding="json", value={"lr": 1})]
        groups = [ParamGroup(optimizer="optim", index=0, params=draw(st.permutations(sorted(meta)))[:2],
                             hyperparams={"lr": 0.1})]
        indexes.append(RankIndex(rank=r, world_size=world, coords={"dp": r}, mesh={"dp": world},
                                 layouts={"model": "fsdp2"}, tensors=tensors, objects=objects,
                                 param_groups=groups, files=[f"r{r}.bin"]))
    return world, indexes


def _files(indexes: list[RankIndex]) -> dict[str, FileEntry]:
    out = {}
    for ix in indexes:
        size = max([0, *(o + n for o, n in zip(ix.chunk_table.offset, ix.chunk_table.length))])
        out[ix.files[0]] = FileEntry(size=size, xxh3="0" * 16, block_size=BLOCK, blocks=["0" * 16] * -(-size // BLOCK))
    return out


def _reference(world: int, indexes: list[RankIndex], files: dict[str, FileEntry]) -> Manifest:
    """The manifest built the plain way (see the module docstring)."""
    entries: dict[str, TensorEntry] = {}
    chunks: dict[str, list] = {}
    for ix in indexes:
        for t in ix.tensors:
            first = entries.setdefault(t.name, t)
            if first.digest is None and t.digest is not None:
                entries[t.name] = first.model_copy(update={"digest": t.digest})
            chunks.setdefault(t.name, []).extend(t.chunks)
    tensors = []
    for name, t in entries.items():
        key = [(c.rank, c.kind == "flat", (c.start,) if c.kind == "flat" else tuple(c.offsets)) for c in chunks[name]]
        ordered = [c for _, _, c in sorted(zip(key, range(len(key)), chunks[name]), key=lambda z: z[:2])]
        tensors.append(TensorEntry(name=name, shape=t.shape, dtype=t.dtype, group=t.group, digest=t.digest,
                                   placement=t.placement, chunks=ordered))
    rng = [ObjectEntry(name="rng", rank=ix.rank, encoding="json", value=ix.objects[0].value) for ix in indexes]
    objects = [indexes[0].objects[1], *([rng[0].model_copy(update={"rank": None})]
                                        if len({o.value for o in rng}) == 1 else rng)]
    params: list = []
    for ix in indexes:
        params += [p for p in ix.param_groups[0].params if p not in params]
    return Manifest(run="r", name="1", step=1, session="s" * 8, created_at=CREATED,
                    topology=Topology(world_size=world, mesh={"dp": world}, layouts={"model": "fsdp2"},
                                      ranks=[RankInfo(rank=ix.rank, coords=ix.coords) for ix in indexes]),
                    tensors=tensors, objects=sorted(objects, key=lambda o: (o.name, -1 if o.rank is None else o.rank)),
                    param_groups=[ParamGroup(optimizer="optim", index=0, params=params, hyperparams={"lr": 0.1})],
                    files=files)


def _merge(world: int, indexes: list[RankIndex], files: dict[str, FileEntry]) -> Manifest:
    return merge_indexes(run="r", name="1", session="s" * 8, step=1, created_at=CREATED, world_size=world,
                         indexes=indexes, files=files)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.randoms(use_true_random=False))
def test_fold_gives_the_reference_manifest_whatever_the_order_indexes_come_in(layout, rnd):
    world, indexes = layout
    files = _files(indexes)
    want = _reference(world, indexes, files).model_dump_json()
    assert _merge(world, indexes, files).model_dump_json() == want
    shuffled = indexes[:]
    rnd.shuffle(shuffled)
    assert _merge(world, shuffled, files).model_dump_json() == want


# -- the store: streaming commit, refusals, completeness -----------------------------------------------

Save = list[tuple[str, bytes, RankIndex]]


def _save(world: int, tensors: int, *, rows: int = 2) -> Save:
    """A row-band save with real bytes: (file, data, index) per rank."""
    out = []
    for r in range(world):
        file, n = f"r{r:06d}-0000.bin", rows * 4 * 2
        data = random.Random(r).randbytes(n * tensors)
        ct = {"tensor": list(range(tensors)), "offsets": [[r * rows, 0]] * tensors, "sizes": [[rows, 4]] * tensors,
              "file": [file] * tensors, "offset": [t * n for t in range(tensors)], "length": [n] * tensors,
              "xxh3": [xxhash.xxh3_64_hexdigest(data[t * n:(t + 1) * n]) for t in range(tensors)]}
        tt = {"name": [f"model.l{t}.w" for t in range(tensors)], "shape": [[rows * world, 4]] * tensors,
              "dtype": ["bfloat16"] * tensors, "group": ["model"] * tensors}
        out.append((file, data, RankIndex.model_validate({"rank": r, "world_size": world, "files": [file],
                                                           "tensor_table": tt, "chunk_table": ct})))
    return out


class CountingStorage(LocalStorage):
    lists = 0  # walks of a session's ranks: the listing that decides
    record_reads = 0  # reads of a file's digest or arrival record
    probes = 0  # listings of one window of ranks

    def list(self, prefix: str) -> list[str]:
        CountingStorage.probes += "/ranks/" in prefix
        return super().list(prefix)

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        CountingStorage.lists += prefix.endswith("/ranks")
        return super().walk(prefix)

    def read_json_or_none(self, key: str):
        CountingStorage.record_reads += "/digests/" in key or "/arrived/" in key
        return super().read_json_or_none(key)

    index_reads = 0  # reads of an object of rank indexes (ckptd.store.rank_indexes)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        CountingStorage.index_reads += "/ranks/" in key
        return super().read(key, start, end)

    def read_or_none(self, key: str) -> bytes | None:
        CountingStorage.index_reads += "/ranks/" in key
        return super().read_or_none(key)

    def local_path(self, key: str):  # a bounded read of an object (``paths.read_small``) opens its path
        CountingStorage.index_reads += "/ranks/" in key and key.endswith(".json")
        return super().local_path(key)


def _declared(ix: RankIndex) -> list[Declared]:
    ct = ix.chunk_table
    rows = zip(ct.tensor, ct.offset, ct.length, ct.xxh3)
    return [Declared(o, n, x, "raw", n, "tensor", str(t)) for t, o, n, x in rows]


def _upload(store: SessionStore, save: Save, name: str, sid: str = "s0000001", *, declare: bool = False) -> None:
    store.open("run", name, OpenSession(session=sid, world_size=save[0][2].world_size, step=1))
    _receive(store, save, name, sid, declare=declare)


def _receive(store: SessionStore, save: Save, name: str, sid: str = "s0000001", *, declare: bool = True) -> None:
    """The files of ``save`` received by ``store`` in a session already open (another replica's, say)."""
    for file, data, ix in save:
        sink = store.intake.receive("run", name, sid, file, declared=_declared(ix) if declare else None)
        sink.write(data)
        sink.finish(None)


def _stored_manifest(store: SessionStore, name: str, sid: str, digest: str) -> bytes:
    return store.storage.read(Paths.manifest("run", name, sid, digest))


def test_streaming_commit_writes_the_merged_manifest_warm_and_cold(tmp_path):
    save = _save(6, 7)
    warm, cold = SessionStore(LocalStorage(tmp_path)), SessionStore(LocalStorage(tmp_path))
    for name in ("a", "b"):
        _upload(warm, save, name)
    for r in random.Random(1).sample(range(6), 6):  # every index through the one store: parsed ones reused
        got = warm.put_index("run", "a", "s0000001", save[r][2])
    assert got.state == "committed" and got.ranks_done == [save[r][2].rank]
    for _, _, ix in save:  # stored by another replica: the commit parses every index
        store_index(cold.storage, "run", "b", "s0000001", ix)
    digest_b = SessionStore(LocalStorage(tmp_path)).committer.commit("run", "b", "s0000001")
    for name, digest in (("a", got.manifest_xxh3), ("b", digest_b)):
        files = {f: FileEntry.model_validate(warm.storage.read_json_or_none(Paths.digest("run", name, "s0000001", f)))
                 for f, _, _ in save}
        want = merge_indexes(run="run", name=name, session="s0000001", step=1,
                             created_at=read_meta(warm.storage, "run", name, "s0000001").created_at, world_size=6,
                             indexes=[ix for _, _, ix in save], files=files)
        assert _stored_manifest(warm, name, "s0000001", digest) == want.model_dump_json().encode()


def _refused(tmp_path: Path, save: Save, error: type, match: str) -> None:
    store = SessionStore(LocalStorage(tmp_path))
    _upload(store, save, "bad")
    for _, _, ix in save[:-1]:
        assert store.put_index("run", "bad", "s0000001", ix).state == "open"
    with pytest.raises(error, match=match):
        store.put_index("run", "bad", "s0000001", save[-1][2])
    assert store.status("run", "bad", "s0000001").state == "failed"


def test_refusals_are_the_typed_errors_of_an_all_at_once_merge(tmp_path):
    save = _save(4, 3)
    # An overlap (rank 2 writes rank 1's rows too): a tiling error naming the tensor.
    ix = save[2][2]
    over = ix.model_copy(update={"chunk_table": ix.chunk_table.model_copy(update={
        "offsets": [(2, 0)] + ix.chunk_table.offsets[1:], "sizes": [(4, 4)] + ix.chunk_table.sizes[1:],
        "length": [32] + ix.chunk_table.length[1:], "offset": [0, 32, 48]})})
    data = save[2][1][:16] + save[2][1]  # 32 bytes for the widened first chunk
    over = over.model_copy(update={"chunk_table": over.chunk_table.model_copy(update={
        "xxh3": [xxhash.xxh3_64_hexdigest(data[:32]), *ix.chunk_table.xxh3[1:]]})})
    _refused(tmp_path / "overlap", [*save[:2], (save[2][0], data, over), save[3]], TilingError, "'model.l0.w'")

    # A shape mismatch on rank 1 and a mesh mismatch on rank 3: the mesh is reported, as when every
    # index was read before any check (the fold records the first problem of each kind).
    shape = save[1][2].model_copy(update={"tensor_table": save[1][2].tensor_table.model_copy(update={
        "shape": [(9, 4)] + save[1][2].tensor_table.shape[1:]})})
    mesh = save[3][2].model_copy(update={"mesh": {"dp": 2, "tp": 2}})
    with pytest.raises(InvalidIndex, match=r"rank 3 reports mesh"):
        merge_indexes(run="r", name="1", session="s" * 8, step=1, created_at=CREATED, world_size=4,
                      indexes=[save[0][2], shape, save[2][2], mesh], files={})
    _refused(tmp_path / "shape", [*save[:1], (save[1][0], save[1][1], shape), *save[2:]], InvalidIndex,
             r"'model.l0.w': rank 0 saved shape \[8, 4\] bfloat16, rank 1 saved shape \[9, 4\]")
    # A file claimed by ranks 0 and 3 wins over rank 1's shape: file ownership is checked before tensors.
    claim = save[3][2].model_copy(update={"files": [save[3][0], save[0][0]]})
    with pytest.raises(InvalidIndex, match=r"claimed by ranks 0 and 3"):
        merge_indexes(run="r", name="1", session="s" * 8, step=1, created_at=CREATED, world_size=4,
                      indexes=[save[0][2], shape, save[2][2], claim], files={})
    with pytest.raises(InvalidIndex, match=r"no index from ranks \[2\]"):
        merge_indexes(run="r", name="1", session="s" * 8, step=1, created_at=CREATED, world_size=4,
                      indexes=[save[0][2], save[1][2], save[3][2], save[3][2]], files={})


def test_a_missing_index_leaves_the_session_open_and_its_retry_commits(tmp_path):
    """An index gone from storage stops the commit at that rank as a storage error (not a verdict: the
    session stays open), and the rank's retried index commits it."""
    save = _save(5, 3)
    store = SessionStore(LocalStorage(tmp_path))
    _upload(store, save, "m")
    for _, _, ix in save:
        store_index(store.storage, "run", "m", "s0000001", ix)
    [key] = [k for k, _ in store.storage.walk(Paths.ranks("run", "m", "s0000001")) if rank_batch(
        k.split("/ranks/")[1]).ranks == (3,)]
    store.storage.delete(key)
    with pytest.raises(StorageError, match="rank 3's index"):
        SessionStore(LocalStorage(tmp_path)).committer.commit("run", "m", "s0000001")
    assert store.status("run", "m", "s0000001").state == "open"
    assert store.put_index("run", "m", "s0000001", save[3][2]).state == "committed"


def test_completeness_is_found_without_listing_every_rank_at_every_index(tmp_path):
    """Two replicas over one root take a session's indexes in a random order: the one that stores
    the last index commits, once; the ranks are listed a few times, not once per index; a replica
    whose hint went stale (the session aborted and opened again) does not commit early."""
    world = 40
    save = _save(world, 2)
    events: list = []
    replicas = [SessionStore(CountingStorage(tmp_path), observers=[AfterCommit(events.append)]) for _ in range(2)]
    _upload(replicas[0], save, "c")
    order = random.Random(3).sample(range(world), world)
    CountingStorage.lists = 0
    for k, r in enumerate(order):
        got = replicas[k % 2].put_index("run", "c", "s0000001", save[r][2])
        assert got.state == ("committed" if k == world - 1 else "open"), (k, got)
        assert got.ranks_done == [r]  # its own rank: no answer grows with the world size
    assert len(events) == 1 and CountingStorage.lists <= 4, (events, CountingStorage.lists)

    stale = SessionStore(LocalStorage(tmp_path))
    _upload(stale, save, "d")
    for _, _, ix in save[:-1]:
        stale.put_index("run", "d", "s0000001", ix)
    stale.sweeper.abort("run", "d", "s0000001")
    _upload(stale, save, "d")
    assert stale.put_index("run", "d", "s0000001", save[-1][2]).state == "open"  # ranks 0..38 are gone
    for _, _, ix in save[:-1]:
        got = stale.put_index("run", "d", "s0000001", ix)
    assert got.state == "committed"


def test_an_index_answer_does_not_grow_with_the_world_size(tmp_path):
    """Ranks whose indexes arrive in rank order (the order that made every answer list every rank below
    it): each answer names its own rank alone, the same size at rank 1 and at rank 198, and the
    status read lists every rank."""
    world = 200
    save = _save(world, 1)
    store = SessionStore(LocalStorage(tmp_path))
    _upload(store, save, "g")
    sizes = set()
    for _, _, ix in save:
        got = store.put_index("run", "g", "s0000001", ix)
        assert got.ranks_done == [ix.rank]
        if got.state == "open":
            sizes.add(len(got.model_dump_json()) - len(str(ix.rank)))
            if ix.rank == world // 2:
                assert store.status("run", "g", "s0000001").ranks_done == list(range(world // 2 + 1))
    assert got.state == "committed" and len(sizes) == 1, sorted(sizes)[-3:]


def test_a_replica_that_stored_few_ranks_probes_a_bounded_number_before_it_lists(tmp_path):
    """Node-local replicas: one replica stores all ranks but two, another the two (its hint is rank 0).
    The other's calls look at no more than ``PROBES`` ranks one by one before a listing decides, so
    the call that stores the last index commits after a few requests, not one per rank in a row."""
    world = 120
    save = _save(world, 1)
    many, few = SessionStore(CountingStorage(tmp_path)), SessionStore(CountingStorage(tmp_path))
    _upload(many, save, "p")
    assert few.put_index("run", "p", "s0000001", save[0][2]).state == "open"
    for _, _, ix in save[1:-1]:
        assert many.put_index("run", "p", "s0000001", ix).state == "open"
    CountingStorage.probes = CountingStorage.lists = 0
    got = few.put_index("run", "p", "s0000001", save[-1][2])
    assert got.state == "committed" and got.ranks_done == [world - 1]
    looks = (CountingStorage.probes, CountingStorage.lists)
    assert looks[0] <= PROBES and looks[1] <= 2 and sum(looks) < world // 4, looks  # not a look per rank


class SlowLooks(CountingStorage):
    """A look at a rank's index (a HEAD, a listing) takes a round trip, as on an object store."""

    def exists(self, key: str) -> bool:
        time.sleep(0.005)
        return super().exists(key)

    def list(self, prefix: str) -> list[str]:
        time.sleep(0.005)
        return super().list(prefix)


def test_indexes_arriving_together_at_a_replica_probe_no_rank_another_replica_stored(tmp_path):
    """Node-local replicas: one stored ranks 0-47, then the other's 16 ranks arrive at once. Each of
    those calls probes only ranks its replica's last listing did not show: no call walks ranks 0-47
    found stored one HEAD at a time (256 HEADs: 16 calls x 16 probes, when each counted from rank 0)."""
    world = 64
    save = _save(world, 1)
    events: list = []
    first, last = (SessionStore(SlowLooks(tmp_path), observers=[AfterCommit(events.append)]) for _ in range(2))
    _upload(first, save, "t")
    for _, _, ix in save[:48]:
        assert first.put_index("run", "t", "s0000001", ix).state == "open"
    CountingStorage.probes = CountingStorage.lists = 0
    with ThreadPoolExecutor(16) as pool:
        states = list(pool.map(lambda ix: last.put_index("run", "t", "s0000001", ix).state, [x for _, _, x in save[48:]]))
    assert states.count("committed") >= 1 and len(events) == 1, (states, events)
    assert CountingStorage.probes <= 32 and CountingStorage.lists <= 16 + 2, (CountingStorage.probes, CountingStorage.lists)


class RemoteLike(LocalStorage):
    """A root with no local path (as S3), whose reads wait for ``barrier`` while one is set."""

    barrier: threading.Barrier | None = None

    def local_path(self, key: str) -> str | None:
        return None

    def read_or_none(self, key: str) -> bytes | None:  # every read of a small record comes here
        if self.barrier is not None:
            self.barrier.wait()
        return super().read_or_none(key)


def test_the_write_gate_reads_its_three_records_at_once_on_a_remote_store(tmp_path):
    """Before every write (a file, an index) the gate reads the session's record, the marker and the
    refusal record: on an object store at once, one round trip instead of three in a row (at 64 ranks
    on S3, the lag from the last byte to the marker 0.59-0.65 -> 0.47-0.51 s). Each read here waits
    until all three are under way: read one after another, the first waits alone and the barrier breaks."""
    storage = RemoteLike(tmp_path)
    store = SessionStore(storage)
    store.open("run", "g", OpenSession(session="s0000001", world_size=2, step=1))
    storage.barrier = threading.Barrier(3, timeout=10 * TIME_SCALE)
    try:
        meta = store.intake.gate.writable("run", "g", "s0000001")
    finally:
        storage.barrier = None
    assert meta.world_size == 2
    storage.put(Paths.failed("run", "g", "s0000001"), b'{"error": {"message": "a tiling gap"}}')
    with pytest.raises(SessionConflict, match="a tiling gap"):  # each refusal as when read one by one
        store.intake.gate.writable("run", "g", "s0000001")
    store.sweeper.abort("run", "g", "s0000001")
    with pytest.raises(SessionNotFound):  # the record first, as before
        store.intake.gate.writable("run", "g", "s0000001")


class HeldRemote(RemoteLike):
    """A remote-like root whose first read of a session record, once ``hold`` is set, waits for it
    after reading (``held`` says it is waiting); reads of session records are counted."""

    hold: threading.Event | None = None
    held = threading.Event()
    meta_reads = 0

    def read_or_none(self, key: str) -> bytes | None:
        data = super().read_or_none(key)
        if key.endswith("/SESSION.json"):
            HeldRemote.meta_reads += 1
            if self.hold is not None and not self.held.is_set():
                self.held.set()
                self.hold.wait(10 * TIME_SCALE)
        return data


def test_writes_arriving_together_share_the_gates_reads_begun_after_they_arrived(tmp_path):
    """Sixteen writes arriving while the gate's reads of a session run are answered by one read begun
    after they arrived, not sixteen (at 64 ranks on S3 the GETs between the last byte and the marker
    37-73 -> 9-10): the session was aborted while the first read ran, before they came, and each of
    them is refused, not answered from the read begun before."""
    storage = HeldRemote(tmp_path)
    store = SessionStore(storage)
    store.open("run", "g", OpenSession(session="s0000001", world_size=2, step=1))
    gate, answers = store.intake.gate, {}

    def write(i: int) -> None:
        try:
            answers[i] = gate.writable("run", "g", "s0000001").world_size
        except SessionNotFound as e:
            answers[i] = e

    HeldRemote.meta_reads, storage.hold = 0, threading.Event()
    first = threading.Thread(target=write, args=(0,))
    first.start()
    assert storage.held.wait(10 * TIME_SCALE)  # the first read has the record: the session is open
    store.sweeper.abort("run", "g", "s0000001")
    later = [threading.Thread(target=write, args=(i,)) for i in range(1, 17)]
    for t in later:
        t.start()
    time.sleep(0.2)  # they arrive while it runs (one late here starts or joins a read of its own)
    storage.hold.set()
    for t in [first, *later]:
        t.join(10 * TIME_SCALE)
    assert answers[0] == 2  # the first read began before the abort
    assert all(isinstance(answers[i], SessionNotFound) for i in range(1, 17)), answers
    assert HeldRemote.meta_reads <= 4, HeldRemote.meta_reads  # one read each: 17


def test_an_index_whose_files_arrived_here_is_checked_and_committed_without_reading_a_record(tmp_path):
    """The replica that received a rank's files checks its index and commits with the records those
    files made here: no digest or arrival record is read back (each is two GETs per file on an object
    store, on the commit's critical path). Another replica reads them from the store, and the commit
    is the same; a session opened again under the same id never meets the records of the one before."""
    save = _save(8, 3)
    here, other = SessionStore(CountingStorage(tmp_path)), SessionStore(CountingStorage(tmp_path))
    for name in ("a", "b"):
        _upload(here, save, name, declare=True)
    CountingStorage.record_reads = 0
    for _, _, ix in save:
        got = here.put_index("run", "a", "s0000001", ix)
    assert got.state == "committed" and CountingStorage.record_reads == 0, CountingStorage.record_reads
    for _, _, ix in save:
        other.put_index("run", "b", "s0000001", ix)
    assert CountingStorage.record_reads == 2 * len(save)  # each file's digest record and arrival record
    manifests = [here.storage.read_json_or_none(Paths.manifest("run", n, "s0000001", d)) for n, d in
                 (("a", got.manifest_xxh3), ("b", here.status("run", "b", "s0000001").manifest_xxh3))]
    assert [(m["files"], m["tensors"]) for m in manifests][0] == [(m["files"], m["tensors"]) for m in manifests][1]
    assert here.status("run", "a", "s0000001").state == "committed"

    # Kept records of an aborted session: the session opened again under its id uploads other bytes
    # at another replica; the index checked here is checked against those (its chunk digests), not the kept.
    _upload(here, save, "c", declare=True)
    here.sweeper.abort("run", "c", "s0000001")
    changed = [(f, bytes(len(d)), ix) for f, d, ix in save]  # zeros: the index's chunk digests no longer match
    _upload(other, changed, "c", declare=False)
    for _, _, ix in save[:-1]:
        assert here.put_index("run", "c", "s0000001", ix).state == "open"
    with pytest.raises(ChecksumMismatch):
        here.put_index("run", "c", "s0000001", save[-1][2])
    assert here.status("run", "c", "s0000001").state == "failed"


def _two_replicas(tmp_path: Path, save: Save, name: str) -> tuple[SessionStore, str]:
    """``save`` through two replicas on one root, the first half of the ranks (files and index) through
    one, their indexes arriving together, the rest through the other, which stores the last index and
    commits: the second, and its digest."""
    one, two = (SessionStore(CountingStorage(tmp_path)) for _ in range(2))
    half = len(save) // 2
    _upload(one, save[:half], name, declare=True)
    _receive(two, save[half:], name)
    with ThreadPoolExecutor(half) as pool:
        assert set(pool.map(lambda ix: one.put_index("run", name, "s0000001", ix).state,
                            [ix for _, _, ix in save[:half]])) == {"open"}
    CountingStorage.index_reads = CountingStorage.record_reads = 0
    for _, _, ix in save[half:]:
        got = two.put_index("run", name, "s0000001", ix)
    assert got.state == "committed"
    return two, got.manifest_xxh3


def test_the_commit_reads_each_object_another_replica_stored_once_and_no_record(tmp_path):
    """The replica that commits reads the other replica's ranks as it stored them: each object once (the
    ranks that arrived together there, with their files' records), no rank's index or record alone; the
    manifest is the one a single replica makes, and every object in the session belongs to the
    checkpoint (no stray) but one planted past the world size."""
    save = _save(16, 3)
    two, digest = _two_replicas(tmp_path, save, "two")
    meta = read_meta(two.storage, "run", "two", "s0000001")
    where = stored(two.storage, "run", "two", "s0000001", meta.created_at.isoformat())
    objects = {where[r] for r in range(8)}  # the other replica's
    assert (CountingStorage.index_reads, CountingStorage.record_reads) == (len(objects), 0), objects
    ref = SessionStore(LocalStorage(tmp_path))
    _upload(ref, save, "ref", declare=True)
    for _, _, ix in save:
        want = ref.put_index("run", "ref", "s0000001", ix)
    ours, theirs = (json.loads(_stored_manifest(ref, n, "s0000001", d)) for n, d in
                    (("two", digest), ("ref", want.manifest_xxh3)))
    assert (ours["files"], ours["tensors"], ours["objects"]) == (theirs["files"], theirs["tensors"], theirs["objects"])
    c = two.visibility.check("run", "two")
    assert strays_of(two.storage, c, two.visibility.manifest(c)) == []
    name = Paths.rank_batch("run", "two", "s0000001", RankBatch(0, 1, "00000000", "00000000", (16,)))  # past the world
    two.storage.put(name, b"{}")
    assert [s.key for s in strays_of(two.storage, c, two.visibility.manifest(c))] == [name]


def test_a_look_finds_the_ranks_another_replica_stored_with_one_listing_of_their_window(tmp_path):
    """A replica whose look found another replica's ranks missing finds them stored later with one probe:
    a listing of their window answers for all 8 (one request per rank before); the save commits."""
    save = _save(16, 3)
    one, two = (SessionStore(CountingStorage(tmp_path)) for _ in range(2))
    _upload(one, save[:8], "n", declare=True)
    _receive(two, save[8:], "n")
    for _, _, ix in save[8:15]:
        assert two.put_index("run", "n", "s0000001", ix).state == "open"  # its looks: ranks 0-7 missing
    for _, _, ix in save[:8]:
        assert one.put_index("run", "n", "s0000001", ix).state == "open"
    CountingStorage.probes = CountingStorage.lists = 0
    assert two.put_index("run", "n", "s0000001", save[15][2]).state == "committed"
    # the probe, then the listing that decides, which the commit reads the objects from
    assert (CountingStorage.probes, CountingStorage.lists) == (1, 1)


def test_an_object_planted_in_the_root_under_a_missing_ranks_name_commits_nothing_unchecked(tmp_path):
    """An outsider who can write in the root plants an object under a name that holds a rank whose index is
    not stored yet: the listing counts that rank, and the commit reads the object, which is not what its
    name says: the session is refused before the marker (``InvalidIndex`` naming the object), as an index
    edited in the root always was; nothing is visible, and a save under a new session commits."""
    save = _save(8, 3)
    store = SessionStore(LocalStorage(tmp_path))
    _upload(store, save, "a", declare=True)
    meta = read_meta(store.storage, "run", "a", "s0000001")
    tag = xxhash.xxh3_64_hexdigest(meta.created_at.isoformat().encode())[:8]  # as an outsider reading SESSION.json can
    planted = Paths.rank_batch("run", "a", "s0000001", RankBatch(0, 9999999999999, "0" * 8, tag, (7,)))
    store.storage.put(planted, b'{"incarnation": "x", "ranks": []}')
    with pytest.raises(InvalidIndex, match=planted.rsplit("/", 1)[1]):
        for _, _, ix in save[:7]:
            store.put_index("run", "a", "s0000001", ix)
    assert store.visibility.check("run", "a") is None
    _upload(store, save, "a", sid="s0000002", declare=True)
    for _, _, ix in save:
        got = store.put_index("run", "a", "s0000002", ix)
    assert got.state == "committed" and verify_committed(store.storage, "run", "a").ok


def test_an_object_whose_index_declares_a_false_chunk_digest_is_refused_like_an_index(tmp_path):
    """An object edited in the root between its storing and the commit, so that an index in it declares a
    false chunk digest: refused before the marker with the ``ChecksumMismatch`` the index itself gets,
    naming the file: the commit confirms what the object says against the bytes as they arrived."""
    save = _save(8, 3)
    one, two = (SessionStore(LocalStorage(tmp_path)) for _ in range(2))
    _upload(one, save[:4], "a", declare=True)
    _receive(two, save[4:], "a")
    one.put_index("run", "a", "s0000001", save[1][2])
    meta = read_meta(one.storage, "run", "a", "s0000001")
    key = stored(one.storage, "run", "a", "s0000001", meta.created_at.isoformat())[1]
    body = json.loads(one.storage.read(key))
    body["ranks"][0]["index"]["chunk_table"]["xxh3"][0] = "0" * 16
    one.storage.put(key, json.dumps(body).encode())
    for r in (0, 2, 3):
        one.put_index("run", "a", "s0000001", save[r][2])
    with pytest.raises(ChecksumMismatch, match="r000001-0000.bin"):
        for _, _, ix in save[4:]:
            two.put_index("run", "a", "s0000001", ix)
    assert two.status("run", "a", "s0000001").state == "failed"


def _again(save: Save, r: int) -> tuple[str, bytes, RankIndex]:
    """Rank ``r``'s index sent again with other bytes, in a file of another name."""
    file, data, ix = save[r]
    other, again = file.replace("-0000.bin", "-0001.bin"), random.Random(1000 + r).randbytes(len(data))
    ct = ix.chunk_table.model_dump()
    n = ct["length"][0]
    ct.update(file=[other] * len(ct["file"]), xxh3=[xxhash.xxh3_64_hexdigest(again[o:o + n]) for o in ct["offset"]])
    return other, again, RankIndex.model_validate({**ix.model_dump(), "files": [other], "chunk_table": ct})


@pytest.mark.parametrize("where", ["the replica that stored it", "the replica that commits"])
def test_an_index_sent_again_with_other_bytes_after_it_was_stored_is_committed_as_sent_last(tmp_path, where):
    """A writer sends rank 1's index again, pointing at other bytes, after it was stored: at the replica
    that stored it, a later object holds the new one; at the replica that commits, the one it kept wins.
    Either way the checkpoint holds the bytes sent last, checked, and the first file is a stray beside it
    (the verdict unchanged)."""
    save = _save(8, 3)
    one, two = (SessionStore(CountingStorage(tmp_path)) for _ in range(2))
    _upload(one, save[:4], "a", declare=True)
    for _, _, ix in save[:4]:
        assert one.put_index("run", "a", "s0000001", ix).state == "open"
    file, data, ix = _again(save, 1)
    at = one if where == "the replica that stored it" else two
    _receive(at, [(file, data, ix)], "a")
    assert at.put_index("run", "a", "s0000001", ix).state == "open"
    _receive(two, save[4:], "a")
    for _, _, other in save[4:]:
        got = two.put_index("run", "a", "s0000001", other)
    assert got.state == "committed"
    manifest = json.loads(_stored_manifest(two, "a", "s0000001", got.manifest_xxh3))
    assert file in manifest["files"] and save[1][0] not in manifest["files"], sorted(manifest["files"])
    c = two.visibility.check("run", "a")
    assert verify_committed(two.storage, "run", "a").ok
    first = save[1][0]  # its bytes and records, which no index of the checkpoint names
    assert sorted(s.key for s in strays_of(two.storage, c, two.visibility.manifest(c))) == \
        sorted(key("run", "a", "s0000001", first) for key in (Paths.file, Paths.digest, Paths.arrival))


# -- memory ------------------------------------------------------------------------------------------

def _cold_commit_peak(root: Path, world: int, tensors: int) -> tuple[int, int]:
    """tracemalloc's peak during a commit from storage alone of ``world`` ranks, and the manifest's size."""
    store = SessionStore(LocalStorage(root))
    name = f"m{world}"
    save = _save(world, tensors)
    _upload(store, save, name)
    for _, _, ix in save:
        store_index(store.storage, "run", name, "s0000001", ix)
    del save
    gc.collect()
    tracemalloc.start()
    try:
        digest = SessionStore(LocalStorage(root)).committer.commit("run", name, "s0000001")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, len(_stored_manifest(store, name, "s0000001", digest))


def test_commit_memory_grows_with_the_manifest_not_with_every_parsed_index(tmp_path):
    """Four times the ranks: the commit's peak grows by under 5x what the manifest's JSON grows by
    (measured 3.6x: the manifest in memory, its offsets and sizes shared, plus the byte checks'
    per-row columns). A commit that reads every index before merging them grows by 9.5x. Measured in a
    fresh interpreter: after this file's other tests the same commits peak 4 MB higher (7.2x), in
    allocations of the tests' leftovers, not the commit's."""
    here = Path(__file__).parent
    code = (f"import json, sys; sys.path[:0] = [{str(here)!r}, {str(here.parents[1])!r}]; "
            f"from test_commit_scale import _cold_commit_peak as p; from pathlib import Path; r = Path({str(tmp_path)!r}); "
            "p(r, 4, 8); print(json.dumps([p(r, 48, 120), p(r, 192, 120)]))")  # the first: modules it imports
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120 * TIME_SCALE).stdout
    (small, small_json), (large, large_json) = json.loads(out.splitlines()[-1])
    ratio = (large - small) / (large_json - small_json)
    assert ratio < 5, (small, large, small_json, large_json, ratio)
