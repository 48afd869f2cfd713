"""Non-tensor objects of a state dict: how they are stored, and how they are read back without running code.

A checkpoint's objects come from whoever could write to its run, so loading one must not run code
from it. Every encode and decode of an object, by the client and by the service, goes through this
module:

save (``build_snapshot``, the DCP writer): :func:`encode_object` for each object leaf. A value that
round-trips through JSON exactly (same types: ``dict`` with ``str`` keys, ``list``, ``str``,
``int``, finite ``float``, ``bool``, ``None``) is stored inline as JSON; anything else as
``torch.save`` bytes, which are loaded back right away with ``weights_only=True`` under the
allow-list. A value that only an unrestricted unpickler can rebuild raises :class:`UnsafeObject`
naming the key, at save time, rather than a checkpoint that no default client can load.

load (``CheckpointClient.load``, the DCP reader, ``ckptd export``): :func:`decode_object`. JSON is
returned as it is; ``torch`` bytes are loaded with ``weights_only=True`` under the allow-list;
``pickle`` bytes, and ``torch`` bytes that name anything outside the allow-list, raise
:class:`UnsafeObject` naming the key and the checkpoint. :func:`load_dcp_metadata` reads DCP's
``Metadata`` the same way, with DCP's metadata dataclasses allowed, and
:func:`load_dcp_file_metadata` a DCP directory's ``.metadata`` file (``ckptd import dcp``).

Before any restricted load, :func:`load_torch` refuses (:class:`UnsafeData`, reported as
``UnsafeObject``) two kinds of data that only use allowed globals: a numpy dtype whose pickled state
carries flags other than the ones numpy computes for it (an object dtype with its flags cleared
turns raw bytes into object pointers during the load), checked by walking the pickle with stubs
in place of every global; and a zip with compressed records (``torch.save`` writes none; torch
inflates a record fully before checking its size).

The allow-list is torch's own (tensors, storages, dtypes, ``torch.Size``, ``OrderedDict``, sets,
...), :func:`default_safe_globals` (numpy arrays, scalars and dtypes: ``np.random.get_state()``),
anything registered with ``torch.serialization.add_safe_globals``, and a client's ``safe_globals``.
Every entry is a constructor the restricted unpickler may call with data from the checkpoint, so
only classes whose construction from arbitrary data is harmless belong there.

:class:`ObjectPolicy` with ``trust=True`` (``CheckpointClient(trust_objects=True)``) turns both
refusals into a :class:`TrustedObjectWarning` (once per policy) and loads with the unrestricted
unpickler: only for checkpoints whose writers are trusted as much as the code of the training job.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import pickle
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import IntegrityError, InvalidRequest, UnsafeObject
from ..manifest import ObjectEntry

__all__ = [
    "Encoded", "ObjectPolicy", "SAFE", "SafeGlobal", "TrustedObjectWarning", "UnsafeData", "check_payload",
    "decode_object",
    "default_safe_globals", "encode_object", "json_exact", "load_dcp_file_metadata", "load_dcp_metadata", "load_torch", "reencode_for_dcp",
]

SafeGlobal = Callable[..., Any] | tuple[Callable[..., Any], str]
"""An allow-list entry, as ``torch.serialization.add_safe_globals`` takes them: a class or function, or
``(callable, "module.name")`` for a name it is pickled under."""

_LOCK = threading.Lock()  # torch's user allow-list is process-wide: one restricted load at a time adds to it


class TrustedObjectWarning(UserWarning):
    """An object was, or may be, loaded with the unrestricted unpickler (``trust_objects=True``)."""


@functools.lru_cache(maxsize=1)
def default_safe_globals() -> tuple[SafeGlobal, ...]:
    """numpy's array, scalar and dtype constructors (``np.random.get_state()``, ``np.float64``, arrays).

    They build an array or scalar of a given dtype from data: an object-dtype array takes its items as
    a list (themselves unpickled under the same restrictions), never as raw pointers, and an ndarray
    subclass would need its own entry. Both module spellings (``numpy.core``: numpy 1,
    ``numpy._core``: numpy 2) are listed so that a checkpoint written under either loads.
    """
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch: no numpy values then
        return ()
    core = getattr(np, "_core", None) or np.core
    ma = core.multiarray
    out: list[SafeGlobal] = [np.ndarray, np.dtype, ma._reconstruct, ma.scalar]
    for spelled in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(ma._reconstruct, f"{spelled}._reconstruct"), (ma.scalar, f"{spelled}.scalar")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: one DType class per dtype
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType") and isinstance(getattr(dtypes, n), type)]
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _dcp_metadata_globals() -> tuple[SafeGlobal, ...]:
    """What ``torch.save(dcp Metadata)`` names: DCP's metadata dataclasses (plain fields, no code), its
    memory-format enum, and the path DCP's file system writer records as the checkpoint id."""
    import pathlib

    from torch.distributed.checkpoint import metadata as m

    return (m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata,
            m.TensorProperties, m.StorageMeta, m._MEM_FORMAT_ENCODING, pathlib.PosixPath, pathlib.PurePosixPath)


@dataclass
class ObjectPolicy:
    """How a client stores and reads objects: the extra allow-list, and whether it trusts its checkpoints."""

    trust: bool = False
    safe_globals: tuple[SafeGlobal, ...] = ()
    _warned: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def of(cls, trust: bool = False, safe_globals: Sequence[SafeGlobal] = ()) -> "ObjectPolicy":
        """A policy; ``trust=True`` warns here, once."""
        policy = cls(trust=bool(trust), safe_globals=tuple(safe_globals))
        if policy.trust:
            policy.warn("trust_objects=True: objects of loaded checkpoints that the safe loader refuses are "
                        "unpickled without restriction, which runs any code a writer of the run put there")
        return policy

    @property
    def allowed(self) -> tuple[SafeGlobal, ...]:
        return default_safe_globals() + self.safe_globals

    def warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, TrustedObjectWarning, stacklevel=4)


SAFE = ObjectPolicy()
"""The default: nothing trusted, the default allow-list only."""


@dataclass(frozen=True)
class Encoded:
    """An object as stored: ``json`` with ``value``, or ``torch`` with ``payload`` (``torch.save`` bytes)."""

    encoding: str
    value: Any = None
    payload: bytes | None = None


def json_exact(value: Any) -> bool:
    """True when JSON gives back a value of the same types and contents (no tuples, subclasses, NaN, ...)."""
    try:
        return _json_exact(value)
    except RecursionError:
        return False


def _json_exact(v: Any) -> bool:
    t = type(v)
    if v is None or t is bool or t is int:
        return True
    if t is float:
        return math.isfinite(v)
    if t is str:
        return _utf8(v)
    if t is list:
        return all(_json_exact(x) for x in v)
    if t is dict:
        return all(type(k) is str and _utf8(k) and _json_exact(x) for k, x in v.items())
    return False


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")  # a lone surrogate does not survive the manifest's JSON
        return True
    except UnicodeEncodeError:
        return False


@contextlib.contextmanager
def _allowing(extra: Sequence[SafeGlobal]) -> Iterator[None]:
    """Add ``extra`` to torch's user allow-list for one load; only what was not there is removed after."""
    with _LOCK:
        present = set(torch.serialization.get_safe_globals())
        missing = list(dict.fromkeys(g for g in extra if g not in present))
        with torch.serialization.safe_globals(missing):
            yield


def _unsafe_globals(data: bytes) -> list[str]:
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - a legacy or damaged file: the refusal stands, without the names
        return []


class UnsafeData(pickle.UnpicklingError):
    """``torch.save`` data that the restricted loader must not read either: a numpy dtype whose stored flags
    differ from the ones numpy gives it, or a compressed zip record (``torch.save`` writes none; one of a
    few KB can inflate to gigabytes before torch checks its size)."""


_DTYPE_FLAGS = 0x7F  # every flag but NPY_ALIGNED_STRUCT (0x80): object references, pointers, init, item access


class _DtypeFactory:
    """``numpy.dtype`` or a ``numpy.dtypes`` class as the pre-scan sees it: calling it records a stub."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __call__(self, *args: Any, **kw: Any) -> "_DtypeStub":
        if kw:
            raise UnsafeData("a numpy dtype built with keyword arguments")
        return _DtypeStub(self.make, args)


class _DtypeStub:
    """A numpy dtype as the pre-scan records it: how it was made, and the real dtype once checked."""

    def __init__(self, make: Any, args: tuple) -> None:
        self.make, self.args, self.real = make, args, None


class _Stub:
    """Anything else the pre-scan meets: accepts every call, item and state, builds nothing."""

    def _ignore(self, *args: Any, **kw: Any) -> None:
        pass

    __init__ = __setitem__ = append = extend = add = __setstate__ = _ignore

    def __call__(self, *args: Any, **kw: Any) -> "_Stub":
        return _Stub()


def _real_dtype(stub: Any, state: Any = None) -> Any:
    """The dtype a stub and its pickled state describe; raises :class:`UnsafeData` when the state's flags
    are not the ones numpy computes for that dtype (flags decide whether items are object pointers)."""
    import numpy as np

    if not isinstance(stub, _DtypeStub):
        raise UnsafeData(f"a numpy dtype whose fields are {type(stub).__name__}, not numpy dtypes")
    if stub.real is not None and state is None:
        return stub.real
    args = stub.args
    if stub.make is np.dtype:
        if not (1 <= len(args) <= 3 and isinstance(args[0], str) and all(type(a) is bool for a in args[1:])):
            raise UnsafeData(f"numpy.dtype called with {len(args)} arguments of unexpected types")
    elif args:
        raise UnsafeData(f"{stub.make.__name__} called with arguments")
    d = stub.make(*args)
    expected = d.flags
    if state is not None:
        if not isinstance(state, tuple) or len(state) < 8:
            raise UnsafeData("a numpy dtype state that is not numpy's")
        state = list(state)
        if state[2] is not None:  # subarray: (base, shape)
            base, shape = state[2]
            state[2] = (_real_dtype(base), shape)
            expected = np.dtype((state[2][0], shape)).flags
        if state[4] is not None:  # fields: {name: (dtype, offset[, title])}
            state[4] = {k: (_real_dtype(v[0]), *v[1:]) for k, v in state[4].items()}
            names = list(state[3])
            expected = np.dtype({"names": names, "formats": [state[4][n][0] for n in names],
                                 "offsets": [state[4][n][1] for n in names], "itemsize": state[5]}).flags
        d.__setstate__(tuple(state))
    if (d.flags ^ expected) & _DTYPE_FLAGS:
        raise UnsafeData(f"a numpy dtype {d} stored with flags {d.flags}, where numpy gives it {expected}: its "
                          f"items would be read as what they are not (raw bytes as object pointers, or objects "
                          f"as raw bytes)")
    stub.real = d
    return d


class _DtypeScan(pickle._Unpickler):  # type: ignore[name-defined]
    """Walks a pickle with every global replaced by a stub, checking each numpy dtype's state as it is built.

    ``weights_only=True`` lets a pickle make a numpy dtype and then set its state, whose flags numpy
    takes as they are: an object dtype stored with its flags cleared makes an array (or a
    ``multiarray.scalar``) whose raw bytes are read as object pointers, during the load itself. Nothing
    from the pickle is called here except ``numpy.dtype`` with a string and booleans and the
    ``numpy.dtypes`` classes without arguments."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        import numpy as np

        if module == "numpy" and name == "dtype":
            return _DtypeFactory(np.dtype)
        if module.split(".")[0] == "numpy":
            found = getattr(getattr(np, "dtypes", None), name, None)
            if isinstance(found, type) and issubclass(found, np.dtype):
                return _DtypeFactory(found)
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()

    def _make(self, make: Any, args: tuple) -> Any:
        for a in args:  # a dtype handed to anything (an array, a scalar) must be one numpy would make
            if isinstance(a, _DtypeStub):
                _real_dtype(a)
        if isinstance(make, _DtypeFactory):
            return make(*args)
        return _Stub()

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, _DtypeStub):
            _real_dtype(inst, state)

    def load_reduce(self) -> None:  # REDUCE and NEWOBJ alike: a callable (or class) and its arguments
        args = self.stack.pop()
        self.stack[-1] = self._make(self.stack[-1], tuple(args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        if kwargs:
            raise UnsafeData("an object built with keyword arguments")
        self.stack[-1] = self._make(self.stack[-1], tuple(args))

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_reduce
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex


def _pickles(f: Any) -> Iterator[bytes]:
    """The bytes of the pickles ``torch.load(f)`` unpickles: each ``data.pkl`` of a zip, else (the legacy
    format) the stream itself, whose first pickles are read one after another."""
    import os
    import zipfile

    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            yield from _pickles(fh)
        return
    pos = f.tell()
    try:
        if zipfile.is_zipfile(f):
            f.seek(pos)
            with zipfile.ZipFile(f) as z:
                packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
                if packed:
                    raise UnsafeData(f"compressed zip records ({', '.join(packed[:3])}), which torch.save never "
                                     f"writes: one could inflate to far more than its stored size")
                for info in z.infolist():
                    if info.filename == "data.pkl" or info.filename.endswith("/data.pkl"):
                        with z.open(info) as member:
                            yield member.read()
        else:
            f.seek(pos)
            yield f.read()
    finally:
        f.seek(pos)


def _check_data(f: Any) -> None:
    """Refuse (:class:`UnsafeData`) compressed zip records, and numpy dtypes whose flags numpy would not give
    them."""
    for head in _pickles(f):
        if b"numpy" not in head:
            continue  # no numpy global is named: no dtype can be made
        scan = io.BytesIO(head)
        for _ in range(5):  # legacy format: magic, protocol, system info, the value, storage keys
            if scan.tell() >= len(head):
                break
            try:
                _DtypeScan(scan).load()
            except UnsafeData:
                raise
            except Exception as e:  # noqa: BLE001 - numpy data the scan cannot follow is not loaded
                raise UnsafeData(f"numpy data that cannot be checked ({type(e).__name__}: {e})") from None


def load_torch(f: Any, *, allowed: Sequence[SafeGlobal], **kw: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with ``allowed`` added to the allow-list for this call, after
    checking that the data has no compressed record and that every numpy dtype in it is one numpy would
    build (:class:`UnsafeData`)."""
    _check_data(f)
    with _allowing(allowed):
        return torch.load(f, weights_only=True, **kw)


def _refusal(what: str, names: list[str], key: str, ref: str | None, encoding: str) -> UnsafeObject:
    where = f"object {key!r}" + (f" of {ref}" if ref else "")
    needs = f" (it names {', '.join(names)})" if names else ""
    return UnsafeObject(
        f"{where}: {what}{needs}; loading it could run code from whoever wrote the checkpoint. Allow "
        f"classes that are safe to build from untrusted data with CheckpointClient(safe_globals=[...]) or "
        f"torch.serialization.add_safe_globals, or pass trust_objects=True for checkpoints whose writers "
        f"you trust", key=key, ref=ref, encoding=encoding, globals=names)


def _decode_torch(data: bytes, key: str, ref: str | None, policy: ObjectPolicy,
                  extra: Sequence[SafeGlobal] = ()) -> Any:
    try:
        return load_torch(io.BytesIO(data), allowed=policy.allowed + tuple(extra))
    except pickle.UnpicklingError as e:
        if not policy.trust:
            if isinstance(e, UnsafeData):
                raise _refusal(f"its torch.save data holds {e}", [], key, ref, "torch") from None
            raise _refusal("its torch.save data needs an unrestricted unpickler", _unsafe_globals(data), key,
                           ref, "torch") from None
        policy.warn(f"object {key!r}" + (f" of {ref}" if ref else "") + f" loaded with the unrestricted "
                    f"unpickler (trust_objects=True): {str(e).splitlines()[0] if str(e) else 'refused'}")
    except Exception as e:  # noqa: BLE001 - the checksum passed: the writer stored bytes torch cannot read
        raise IntegrityError(f"object {key!r}" + (f" of {ref}" if ref else "") + f": its torch.save data cannot "
                             f"be decoded ({type(e).__name__}: {e})", key=key, ref=ref) from None
    return torch.load(io.BytesIO(data), weights_only=False)


def decode_object(entry: ObjectEntry, data: bytes | None, *, ref: str | None = None,
                  policy: ObjectPolicy = SAFE) -> Any:
    """The value of ``entry`` from its stored bytes (``data``; None for a JSON object)."""
    if entry.encoding == "json":
        return entry.value
    assert data is not None
    if entry.encoding == "torch":
        return _decode_torch(data, entry.name, ref, policy)
    if entry.encoding == "pickle":
        if not policy.trust:
            raise _refusal("it is stored as pickle, which only an unrestricted unpickler reads", [], entry.name,
                           ref, "pickle")
        policy.warn(f"object {entry.name!r}" + (f" of {ref}" if ref else "") +
                    " is stored as pickle and was unpickled without restriction (trust_objects=True)")
        return pickle.loads(data)
    raise InvalidRequest(f"object {entry.name!r}: unknown encoding {entry.encoding!r}", key=entry.name)


def reencode_for_dcp(entry: ObjectEntry, data: bytes | None, *, ref: str | None = None,
                     policy: ObjectPolicy = SAFE) -> bytes:
    """``torch.save`` bytes of the object for DCP's planner, which unpickles them without restriction:
    the value is decoded here under the policy first, so what DCP reads holds only allowed globals."""
    if entry.encoding == "torch" and policy.trust and data is not None:
        return data
    buf = io.BytesIO()
    torch.save(decode_object(entry, data, ref=ref, policy=policy), buf)
    return buf.getvalue()


def load_dcp_metadata(data: bytes, *, key: str, ref: str | None = None, policy: ObjectPolicy = SAFE) -> Any:
    """DCP's ``Metadata`` from its ``torch.save`` bytes, with DCP's metadata classes allowed."""
    return _decode_torch(data, key, ref, policy, _dcp_metadata_globals())


class _DcpFileMetadataUnpickler(pickle.Unpickler):
    """pickle's own way to restrict globals (``find_class``): DCP's metadata and storage-entry classes,
    torch dtypes, ``torch.Size`` and torch's layout lookup; no persistent ids, so no storages."""

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        allowed = (*_dcp_metadata_globals(), MetadataIndex, _StorageInfo, torch.Size, torch.serialization._get_layout)
        self.allowed = {f"{g.__module__}.{g.__qualname__}": g for g in allowed}
        self.allowed.update({f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not one of DCP's metadata classes")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def load_dcp_file_metadata(f: Any) -> Any:
    """The ``Metadata`` of a DCP directory's ``.metadata`` file (a plain pickle, which DCP's own
    ``FileSystemReader.read_metadata`` unpickles without restriction), read with the globals restricted."""
    return _DcpFileMetadataUnpickler(f).load()


def encode_object(key: str, value: Any, policy: ObjectPolicy = SAFE) -> Encoded:
    """How ``value`` is stored: JSON when it round-trips exactly, else ``torch.save`` bytes that load
    back under the allow-list; raises :class:`UnsafeObject` (naming ``key``) when they would not,
    unless the policy trusts objects."""
    if json_exact(value):
        return Encoded("json", value=value)
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - lambdas, open files, locks: not storable at all
        raise InvalidRequest(f"object {key!r}: a {type(value).__qualname__} cannot be serialised "
                             f"({type(e).__name__}: {e})", key=key) from e
    payload = buf.getvalue()
    check_payload(key, payload, policy, what=f"a {type(value).__module__}.{type(value).__qualname__}")
    return Encoded("torch", payload=payload)


def check_payload(key: str, payload: bytes, policy: ObjectPolicy = SAFE, *, what: str = "its value") -> None:
    """At save: refuse ``torch.save`` bytes that a default (restricted) load would refuse."""
    try:
        load_torch(io.BytesIO(payload), allowed=policy.allowed)
    except pickle.UnpicklingError:
        names = _unsafe_globals(payload)
        if not policy.trust:
            raise UnsafeObject(
                f"object {key!r}: {what} cannot be stored safely: loading it would need an unrestricted "
                f"unpickler" + (f" (it names {', '.join(names)})" if names else "") + ". Store plain data "
                "(dicts, lists, numbers, strings, tensors), allow its classes with "
                "CheckpointClient(safe_globals=[...]) if they are safe to build from untrusted data, or pass "
                "trust_objects=True", key=key, globals=names) from None
        policy.warn(f"object {key!r}: {what} is stored for the unrestricted unpickler (trust_objects=True); "
                    f"clients without trust_objects=True refuse to load it")
