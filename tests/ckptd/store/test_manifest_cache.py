"""The parsed manifests the read side keeps are bounded in bytes (``Visibility(cache_bytes=...)``), not in
count: at 10,000 ranks one manifest is hundreds of MB parsed, so a count of 64 bounded nothing. The
least recently read go first; the one in use always stays; a data read's shortcut (``CheckpointReader``)
holds no manifest of its own that would outlive the bound."""

from __future__ import annotations

import gc
import time
import weakref

import torch

from ckptd.storage.local import LocalStorage
from stored_tensors import write_tensors
from ckptd.store.reader import CheckpointReader
from ckptd.store.sessions import SessionStore
from ckptd.store.visibility import MEMORY_PER_MANIFEST_BYTE, Visibility


def _root(tmp_path, n: int) -> LocalStorage:
    storage = LocalStorage(tmp_path)
    for step in range(1, n + 1):
        write_tensors(SessionStore(storage), f"c/{step}", {f"model.w{k}": torch.full((4, 4), float(step))
                                                           for k in range(3 * step)}, step=step)
    return storage


def _cost(storage: LocalStorage, vis: Visibility, step: int) -> int:
    return MEMORY_PER_MANIFEST_BYTE * len(vis.manifest_bytes(vis.resolve("c", str(step))))


def test_the_cache_keeps_manifests_within_its_bytes_newest_read_first(tmp_path) -> None:
    storage = _root(tmp_path, 4)
    probe = Visibility(storage)
    costs = {s: _cost(storage, probe, s) for s in range(1, 5)}
    assert len(set(costs.values())) == 4  # manifests of different sizes: the count is not the bound
    vis = Visibility(storage, cache_bytes=costs[3] + costs[4])
    for s in (1, 2, 3, 4):
        vis.manifest(vis.resolve("c", str(s)))
    digests = {s: vis.resolve("c", str(s)).digest for s in range(1, 5)}
    held = {s for s, d in digests.items() if vis.cached(d) is not None}
    assert held == {3, 4}
    vis.manifest(vis.resolve("c", "3"))  # 3 read again: now 4 is the least recently read
    vis.manifest(vis.resolve("c", "2"))
    held = {s for s, d in digests.items() if vis.cached(d) is not None}
    assert held == {2, 3}, held


def test_a_manifest_larger_than_the_bound_is_kept_while_in_use_only(tmp_path) -> None:
    storage = _root(tmp_path, 2)
    vis = Visibility(storage, cache_bytes=1)
    one = vis.manifest(vis.resolve("c", "1"))
    assert vis.cached(vis.resolve("c", "1").digest) is one
    vis.manifest(vis.resolve("c", "2"))
    assert vis.cached(vis.resolve("c", "1").digest) is None
    assert vis.cached(vis.resolve("c", "2").digest) is not None


def test_data_reads_hold_no_manifest_past_the_cache(tmp_path) -> None:
    storage = _root(tmp_path, 2)
    reader = CheckpointReader(storage, visibility=Visibility(storage, cache_bytes=1))
    manifest = reader.manifest("c", "1")
    file = next(iter(manifest.files))
    reader.file_key("c", "1", file)  # the shortcut remembers checkpoint 1
    gone = weakref.ref(manifest)
    del manifest
    reader.file_key("c", "2", next(iter(reader.manifest("c", "2").files)))  # evicts checkpoint 1
    gc.collect()
    assert gone() is None, "a data read's shortcut kept an evicted manifest alive"
    key, size = reader.file_key("c", "1", file)  # and a read of it still works, reading it again
    assert size > 0 and key.endswith(file)


def test_ranks_asking_at_once_make_one_parse_and_one_tree(tmp_path, monkeypatch) -> None:
    """Every rank of a resume asks for the same checkpoint's load tree at once: the manifest is parsed
    once and its tree built once, the other callers wait and take them from the cache."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.store import visibility as vis_module
    from ckptd_schemas import Manifest

    storage = _root(tmp_path, 1)
    vis = Visibility(storage)
    c = vis.resolve("c", "1")
    calls = {"parse": 0, "tree": 0}
    parse, tree = Manifest.model_validate_json, vis_module.LoadTree

    def counted_parse(raw, *a, **kw):
        calls["parse"] += 1
        time.sleep(0.05)  # a parse that takes a while, as a large one does
        return parse(raw, *a, **kw)

    class CountedTree(tree):  # type: ignore[misc, valid-type]
        def __init__(self, m) -> None:
            calls["tree"] += 1
            time.sleep(0.05)
            super().__init__(m)

    fresh = Visibility(storage)
    monkeypatch.setattr(Manifest, "model_validate_json", staticmethod(counted_parse))
    monkeypatch.setattr(vis_module, "LoadTree", CountedTree)
    with ThreadPoolExecutor(16) as pool:
        roots = list(pool.map(lambda _: fresh.load_tree(fresh.resolve("c", "1")).root, range(32)))
    assert set(roots) == {c.marker.load_tree}
    assert calls == {"parse": 1, "tree": 1}, calls
