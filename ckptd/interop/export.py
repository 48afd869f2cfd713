"""Export a committed checkpoint: Hugging Face style sharded safetensors, or one ``torch.save`` file.

Call order for safetensors (:func:`export_safetensors`):

1. select the tensors (``prefix`` filters and is stripped), choose the output dtype
   (``dtype`` casts floating tensors) and cut them into shards of at most
   ``max_shard_size`` bytes (a bigger tensor gets a shard of its own), all from the
   manifest: names and sizes are known before a byte is read;
2. per shard, write the header first (8-byte little-endian length, JSON with dtype, shape
   and data offsets, space padded to 8 bytes), then stream each tensor in row-major slabs
   of at most ``slab_bytes``: each slab is assembled from whatever chunks hold it (read
   plan, block digests verified), cast, hashed (XXH3-64) and appended by a writer thread
   while the next slab is assembled. Memory held: two slabs. Files are written under
   temporary names, handed to write-back as they grow, fsynced and renamed when complete;
3. ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``);
4. check: every shard is opened with ``safetensors.safe_open`` (which validates the header)
   and each tensor's bytes, read back where that header puts them, are hashed (XXH3-64) and
   compared with the digest of the bytes assembled from the source (and, uncast, with the
   digest the manifest records when it has one). Any difference raises
   :class:`ckptd_schemas.IntegrityError` naming the tensor and file; the outputs are removed.

Without ``dtype`` the safetensors path assembles on the host engine (numpy) and never imports
torch, whose import is most of such a command's start (BENCHMARKS.md, Figures behind the code).

``torch`` format (:func:`export_torch`): the nested state dict (nested as DCP recorded it
for checkpoints saved through DCP or imported from it; flat FQN keys otherwise), objects
included, in one ``torch.save`` file. Each tensor is assembled slab by slab into its own
memory-mapped temporary file, so the data lives in the page cache, not in the process's
heap, while ``torch.save`` writes it; the file is then read back (``mmap=True``) and checked
the same way. Objects, and DCP's metadata, are decoded without running code from the
checkpoint (``ckptd_schemas.format.objects``: JSON, or ``torch.load(weights_only=True)`` under the
allow-list); one that needs an unrestricted unpickler raises ``UnsafeObject`` unless
``trust_objects`` (``ckptd export --trust-objects``).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import xxhash

from ckptd_schemas.names import DCP_METADATA, RESERVED
from ckptd_schemas import (
    ITEMSIZE, Copy, IntegrityError, InvalidRequest, Manifest, ObjectEntry, TensorEntry,
)
from ckptd_schemas.digest import StreamHasher
from ckptd_schemas.dtypes import FLOATING as FLOATS

from ..storage.local import LocalStorage, fsync_dir
from ckptd_schemas.format.engines import ChunkBuffer, iter_slabs, pick_engine
from ckptd_schemas.readplan import ReadFn
from ..store.reader import naming_tensor
from ..store.space import parse_size as store_size

if TYPE_CHECKING:
    from ckptd_schemas.format.objects import ObjectPolicy

__all__ = ["ExportResult", "FLOATS", "MODEL_PREFIX", "SAFETENSORS_DTYPES", "default_prefix",
           "export_safetensors", "export_torch", "parse_size", "tensor_bytes"]

MODEL_PREFIX = "model."  # the key a state dict of a model and its optimizer keeps the weights under

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
}


def parse_size(text: str | int) -> int:
    """``5GB`` (10^9, as Hugging Face counts), ``500MiB`` (2^20), or plain bytes (the one size grammar:
    :func:`ckptd.store.space.parse_size`), more than 0."""
    try:
        n = text if isinstance(text, int) else store_size(str(text))
    except ValueError as e:
        raise InvalidRequest(f"invalid size {text!r}: {e}", value=str(text)) from None
    if n <= 0:
        raise InvalidRequest(f"size {text!r} must be positive", value=str(text))
    return n


@dataclass
class ExportResult:
    ref: str
    format: str
    out: str
    files: list[str]
    tensors: int
    total_size: int
    seconds: float
    objects: int = 0
    digests: dict[str, str] = field(default_factory=dict)
    nested: bool = False


@dataclass(frozen=True)
class _Out:
    src: TensorEntry
    name: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.src.shape) * ITEMSIZE[self.dtype]


def tensor_bytes(shape: list[int], dtype: str) -> int:
    return prod(shape) * ITEMSIZE[dtype]


def default_prefix(manifest: Manifest, fmt: str) -> str | None:
    """What an export selects when not told: for safetensors, the model's weights (the tensors under
    ``model.``, without it, as ``{"model": ..., "optim": ...}`` state dicts, DCP's examples and
    torchtitan keep them) when the checkpoint has any; every tensor otherwise, and always for the
    torch format (a whole state dict, to resume from)."""
    if fmt == "safetensors" and any(t.name.startswith(MODEL_PREFIX) for t in manifest.tensors):
        return MODEL_PREFIX
    return None


def _select(manifest: Manifest, prefix: str | None, dtype: str | None) -> list[_Out]:
    if dtype is not None and dtype not in FLOATS:
        raise InvalidRequest(f"--dtype must be a floating dtype, one of {sorted(FLOATS)}, not {dtype!r}", dtype=dtype)
    out = []
    for t in manifest.tensors:
        if prefix and not t.name.startswith(prefix):
            continue
        name = t.name[len(prefix):] if prefix else t.name
        if not name:
            continue
        out.append(_Out(t, name, dtype if dtype is not None and t.dtype in FLOATS else t.dtype))
    if not out:
        raise InvalidRequest(f"checkpoint {manifest.ref} has no tensor starting with {prefix!r}" if prefix
                             else f"checkpoint {manifest.ref} has no tensors", prefix=prefix)
    _check_names(out)
    return out


class _Pipelined:
    """A :class:`ChunkBuffer` that turns between two buffers, with one writer thread: slab k is read and
    assembled while slab k-1 is being written, so the disk reads and writes at once (a serial export
    waits for each in turn). ``begin`` takes the other buffer, after waiting for that buffer's own write
    to finish; writes run in submission order. ``drain`` waits for every write and re-raises a failure.
    """

    def __init__(self, make: Callable[[], ChunkBuffer]) -> None:
        self._bufs = [make(), make()]
        self._writes: list[Future | None] = [None, None]
        self._i = 1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-export-write")

    def begin(self, dtype: str, numel: int, global_shape: Sequence[int], **where: Any) -> None:
        self._i ^= 1
        self._wait(self._i)
        self._bufs[self._i].begin(dtype, numel, global_shape, **where)

    def copy(self, data: memoryview, c: Copy) -> None:
        self._bufs[self._i].copy(data, c)

    def result(self, dtype: str) -> memoryview:
        return self._bufs[self._i].result(dtype)

    def write(self, fn: Callable[[memoryview], None], raw: memoryview) -> None:
        """Write ``raw`` (a view into the current buffer) with ``fn`` on the writer thread."""
        self._writes[self._i] = self._pool.submit(fn, raw)

    def _wait(self, i: int) -> None:
        fut, self._writes[i] = self._writes[i], None
        if fut is not None:
            fut.result()

    def drain(self) -> None:
        try:
            for i in (self._i ^ 1, self._i):  # the older write first
                self._wait(i)
        finally:
            self._pool.shutdown(wait=True)


def _stream(manifest: Manifest, o: _Out, read: ReadFn, buffer: ChunkBuffer, write: Callable[[memoryview], None], *,
            slab_bytes: int, progress: Callable[[int], None] | None = None) -> str:
    """Assemble ``o`` slab by slab (row-major) in ``buffer`` (its stored bytes at most ``slab_bytes`` a
    slab), cast, write; return the XXH3-64 of the bytes written."""
    t = o.src
    h = xxhash.xxh3_64()
    src_h = StreamHasher() if t.digest is not None else None  # the layout-independent digest, before any cast
    slab = max(1, slab_bytes // max(ITEMSIZE[t.dtype], ITEMSIZE[o.dtype]))
    slabs = iter_slabs(manifest, t, read, slab_elems=slab, buffer=buffer, dtype=o.dtype)
    while True:
        with naming_tensor(t.name, manifest.ref):
            got = next(slabs, None)
        if got is None:
            break
        stored, raw = got
        if src_h is not None:
            src_h.update(stored)
        h.update(raw)
        write(raw)
        if progress:
            progress(len(raw))
    if src_h is not None:
        got = src_h.hexdigest()
        if got != t.digest:
            raise IntegrityError(f"tensor {t.name!r} of {manifest.ref}: assembled bytes hash to {got}, the manifest "
                                 f"records {t.digest}", tensor=t.name)
    return h.hexdigest()


def _shards(outs: list[_Out], max_shard_size: int) -> list[list[_Out]]:
    shards: list[list[_Out]] = []
    size = 0
    for o in outs:
        if not shards or (shards[-1] and size + o.nbytes > max_shard_size):
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    return shards


def _header(shard: list[_Out]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for o in shard:  # every dtype one safetensors stores (export_safetensors refused others)
        head[o.name] = {"dtype": SAFETENSORS_DTYPES[o.dtype], "shape": list(o.src.shape),
                        "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _check_names(outs: list[_Out]) -> None:
    seen: dict[str, str] = {}
    for o in outs:
        if o.name in seen:
            raise InvalidRequest(f"tensors {seen[o.name]!r} and {o.src.name!r} both export as {o.name!r}",
                                 tensor=o.name)
        if o.name == "__metadata__":
            raise InvalidRequest(f"tensor {o.src.name!r} would export as the reserved name '__metadata__'",
                                 tensor=o.src.name)
        seen[o.name] = o.src.name


def _prepare_dir(out: Path, names: list[str]) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidRequest(f"{out} exists and is not a directory", path=str(out))
    out.mkdir(parents=True, exist_ok=True)
    clash = [n for n in names if (out / n).exists()]
    if clash:
        raise InvalidRequest(f"{out} already holds {clash[:3]}: choose an empty directory", path=str(out))


def _data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file (absolute [begin, end)), as its header says."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in head.items()
            if k != "__metadata__"}


def check_safetensors(out: Path, files: list[str], digests: dict[str, str], *, slab_bytes: int = 64 << 20,
                      progress: Callable[[int], None] | None = None) -> None:
    """Open every shard with ``safetensors.safe_open``, which validates its header (dtypes, shapes, and data
    offsets that tile the data exactly), and compare each tensor's digest with the source's, reading the
    bytes where that header puts them, ``slab_bytes`` at a time (memory held: one slab, no mapping)."""
    from safetensors import safe_open

    index = json.loads((out / INDEX_FILE).read_text())
    seen: set[str] = set()
    buf = bytearray(slab_bytes)
    for fname in files:
        with safe_open(str(out / fname), framework="numpy") as f:  # numpy: no torch import; nothing is loaded
            meta = {name: (list(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
        spans = _data_spans(out / fname)
        with open(out / fname, "rb", buffering=0) as fh:
            for name, (shape, sdt) in meta.items():
                if index["weight_map"].get(name) != fname:
                    raise IntegrityError(f"{out / fname}: tensor {name!r} is not mapped to this file by "
                                         f"{INDEX_FILE}", file=fname, tensor=name)
                dt = next(k for k, v in SAFETENSORS_DTYPES.items() if v == sdt)
                a, b = spans[name]
                if b - a != tensor_bytes(shape, dt):
                    raise IntegrityError(f"{out / fname}: tensor {name!r} spans {b - a} bytes, not the "
                                         f"{tensor_bytes(shape, dt)} of {dt}{shape}", file=fname, tensor=name)
                h = xxhash.xxh3_64()
                while a < b:
                    n = os.preadv(fh.fileno(), [memoryview(buf)[:min(slab_bytes, b - a)]], a)
                    if n <= 0:
                        raise IntegrityError(f"{out / fname}: tensor {name!r} is cut short at byte {a}",
                                             file=fname, tensor=name)
                    h.update(memoryview(buf)[:n])
                    a += n
                if h.hexdigest() != digests.get(name):
                    raise IntegrityError(f"{out / fname}: tensor {name!r} reads back with digest {h.hexdigest()}, "
                                         f"the source bytes have {digests.get(name)}", file=fname, tensor=name)
                seen.add(name)
                if progress:
                    progress(tensor_bytes(shape, dt))
    missing = sorted(set(digests) - seen)
    if missing:
        raise IntegrityError(f"{out}: tensors missing from the shards: {missing[:5]}", tensors=missing[:64])


def export_safetensors(manifest: Manifest, read: ReadFn, out: str | os.PathLike, *, max_shard_size: int = 5 * 10**9,
                       dtype: str | None = None, prefix: str | None = None, slab_bytes: int = 32 << 20,
                       check: bool = True, progress: Callable[[int], None] | None = None,
                       check_progress: Callable[[int], None] | None = None) -> ExportResult:
    """Write ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` under ``out``.

    Memory held: two slabs of ``slab_bytes`` (one assembled while the other is written) and one read."""
    if sys.byteorder != "little":
        raise InvalidRequest("safetensors export needs a little-endian machine")
    t0 = time.monotonic()
    outs = _select(manifest, prefix, dtype)
    for o in outs:
        if o.dtype not in SAFETENSORS_DTYPES:
            raise InvalidRequest(f"tensor {o.src.name!r} has dtype {o.dtype}, which safetensors cannot store",
                                 tensor=o.src.name)
    shards = _shards(outs, max_shard_size)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    root = Path(out)
    _prepare_dir(root, names + [INDEX_FILE])
    digests: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    # Each file is written under a temporary name, handed to write-back every 32 MiB (so the fsync waits
    # for the last window only, while the next slabs are still being read), fsynced and renamed.
    disk = LocalStorage(root, durable=True)
    engine = pick_engine("cpu", casts=dtype is not None)  # numpy on the host (no torch import) unless it casts
    written: list[Path] = []
    writer = None
    try:
        for fname, shard in zip(names, shards):
            writer = disk.open_write(fname)
            writer.write(_header(shard))
            pipe = _Pipelined(lambda: engine.buffer(slab_bytes))
            try:
                for o in shard:
                    digests[o.name] = _stream(manifest, o, read, pipe, lambda raw, w=writer.write: pipe.write(w, raw),
                                              slab_bytes=slab_bytes, progress=progress)
                    weight_map[o.name] = fname
            except BaseException:
                with contextlib.suppress(Exception):  # the writes in flight end before the file is removed
                    pipe.drain()
                raise
            pipe.drain()
            writer.commit()
            written.append(root / fname)
        index = {"metadata": {"total_size": sum(o.nbytes for o in outs), "ckptd_source": manifest.ref},
                 "weight_map": dict(sorted(weight_map.items()))}
        writer = disk.open_write(INDEX_FILE)
        writer.write((json.dumps(index, indent=2) + "\n").encode())
        writer.commit()
        written.append(root / INDEX_FILE)
        if check:
            check_safetensors(root, names, digests, slab_bytes=slab_bytes, progress=check_progress)
    except BaseException:
        if writer is not None:
            writer.abort()  # no-op once committed
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return ExportResult(ref=manifest.ref, format="safetensors", out=str(root), files=names + [INDEX_FILE],
                        tensors=len(outs), total_size=sum(o.nbytes for o in outs), seconds=time.monotonic() - t0,
                        objects=0, digests=digests)


# -- torch.save --------------------------------------------------------------------------------------

def _dcp_layout(manifest: Manifest, read: ReadFn, policy: "ObjectPolicy") -> tuple[dict[str, tuple], list[str]] | None:
    """DCP's key paths (``fqn -> ("optim", "param_groups", 0, "lr")``) and key order, when the checkpoint
    carries DCP metadata (saved through ``client.dcp_writer`` or imported from a DCP directory)."""
    from ckptd_schemas.format.objects import load_dcp_metadata

    stored = next((o for o in manifest.objects if o.name == DCP_METADATA and o.location is not None), None)
    if stored is None:
        return None
    md = load_dcp_metadata(_object_bytes(manifest, stored, read), key=DCP_METADATA, ref=manifest.ref, policy=policy)
    pd = getattr(md, "planner_data", None)
    if not isinstance(pd, dict):
        return None
    return {k: tuple(v) for k, v in pd.items()}, list(md.state_dict_metadata)


def _object_bytes(manifest: Manifest, o: ObjectEntry, read: ReadFn) -> bytes:
    loc = o.location
    assert loc is not None
    return o.checked(read(loc.file, loc.offset, loc.offset + loc.length), manifest.ref)


def export_torch(manifest: Manifest, read: ReadFn, out: str | os.PathLike, *, dtype: str | None = None,
                 prefix: str | None = None, slab_bytes: int = 64 << 20, check: bool = True,
                 progress: Callable[[int], None] | None = None,
                 check_progress: Callable[[int], None] | None = None, trust_objects: bool = False) -> ExportResult:
    """One ``torch.save`` file of the state dict: tensors (optionally cast, prefix-filtered) and objects.

    An object that needs an unrestricted unpickler raises ``UnsafeObject`` (and nothing is written)
    unless ``trust_objects``."""
    import torch
    from torch.distributed.checkpoint._traverse import get_element, set_element  # DCP's own key paths

    from ckptd_schemas.format.assemble import torch_dtype
    from ckptd_schemas.format.objects import ObjectPolicy, decode_object, load_torch

    policy = ObjectPolicy.of(trust_objects)

    t0 = time.monotonic()
    outs = _select(manifest, prefix, dtype)
    path = Path(out)
    if path.exists():
        raise InvalidRequest(f"{path} already exists: choose a new file", path=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = _dcp_layout(manifest, read, policy)
    paths, order = layout if layout is not None else ({}, [])
    objects: dict[str, ObjectEntry] = {}
    for o in manifest.objects:  # a per-rank object: the lowest rank's value (DCP keeps one per key)
        if o.name.startswith(RESERVED) or (prefix and not o.name.startswith(prefix)):
            continue
        prev = objects.get(o.name)
        if prev is None or (prev.rank is not None and (o.rank is None or o.rank < prev.rank)):
            objects[o.name] = o

    def key_path(fqn: str) -> tuple:
        stripped = fqn[len(prefix):] if prefix else fqn
        p = paths.get(fqn)
        if p is None:
            return (stripped,)
        if prefix:  # drop the leading path components that spell the prefix, if they do
            for k in range(1, len(p) + 1):
                if ".".join(str(x) for x in p[:k]) + "." == prefix:
                    return p[k:] if p[k:] else (stripped,)
            return (stripped,)
        return p

    # Fill in DCP's key order (so dicts iterate as dcp_to_torch_save's do), then anything else.
    rank_of = {k: i for i, k in enumerate(order)}
    pending: list[tuple[str, Any]] = [("t", o) for o in outs] + [("o", n) for n in objects]
    pending.sort(key=lambda p: rank_of.get(p[1].src.name if p[0] == "t" else p[1], len(rank_of)))
    sd: dict = {}
    digests: dict[str, str] = {}
    buffer = pick_engine("cpu", casts=dtype is not None).buffer(slab_bytes)
    tmpdir = tempfile.mkdtemp(prefix=".ckptd-export-", dir=path.parent)
    partial = path.with_name(f".{path.name}.partial")
    try:
        for i, (kind, item) in enumerate(pending):
            if kind == "o":
                entry = objects[item]
                value = decode_object(entry, None if entry.location is None else _object_bytes(manifest, entry, read),
                                      ref=manifest.ref, policy=policy)
                set_element(sd, key_path(item), value)
                continue
            o = item
            numel = prod(o.src.shape)
            if numel:
                backing = os.path.join(tmpdir, f"t{i}")
                flat = torch.from_file(backing, shared=True, size=numel, dtype=torch_dtype(o.dtype))
                os.unlink(backing)  # the mapping stays valid; the space is freed when the tensor goes
            else:
                flat = torch.empty(0, dtype=torch_dtype(o.dtype))
            pos = 0

            def write(raw: memoryview, flat: torch.Tensor = flat) -> None:
                nonlocal pos
                n = len(raw)
                flat.view(torch.uint8)[pos:pos + n].copy_(torch.frombuffer(raw, dtype=torch.uint8))
                pos += n

            digests[o.name] = _stream(manifest, o, read, buffer, write, slab_bytes=slab_bytes, progress=progress)
            set_element(sd, key_path(o.src.name), flat.view(o.src.shape))
        torch.save(sd, partial)
        del sd
        if check:
            # the file just written: its objects are the ones decoded above, under the same policy
            back = (torch.load(partial, mmap=True, weights_only=False) if policy.trust
                    else load_torch(partial, allowed=policy.allowed, mmap=True))
            for o in outs:
                t = get_element(back, key_path(o.src.name))  # None where it is missing
                if not isinstance(t, torch.Tensor) or t.dtype != torch_dtype(o.dtype):
                    raise IntegrityError(f"{path}: {o.name!r} reads back as {type(t).__name__} "
                                         f"{getattr(t, 'dtype', '')}, not a {o.dtype} tensor", file=str(path),
                                         tensor=o.name)
                # saved contiguous and loaded mapped: hashed where it lies in the file's pages, not copied
                got = xxhash.xxh3_64_hexdigest(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                if got != digests[o.name]:
                    raise IntegrityError(f"{path}: tensor {o.name!r} reads back with digest {got}, the source bytes "
                                         f"have {digests[o.name]}", file=str(path), tensor=o.name)
                if check_progress:
                    check_progress(o.nbytes)
            del back
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())  # renamed into place only once its bytes are on disk
        os.replace(partial, path)
        fsync_dir(path.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        for leftover in Path(tmpdir).glob("*"):
            leftover.unlink(missing_ok=True)
        os.rmdir(tmpdir)
    return ExportResult(ref=manifest.ref, format="torch", out=str(path), files=[path.name], tensors=len(outs),
                        total_size=sum(o.nbytes for o in outs), seconds=time.monotonic() - t0,
                        objects=len(objects), digests=digests, nested=layout is not None)

