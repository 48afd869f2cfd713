"""``ckptd_schemas.format.objects``: how non-tensor objects are stored, and that reading one runs no code.

* ``json_exact`` / ``encode_object``: a value stored as JSON is one that JSON gives back with the same
  types; anything else is ``torch.save`` bytes that a restricted load reads back (checked at save);
* a value only an unrestricted unpickler rebuilds is refused at save (``UnsafeObject`` naming the key
  and the globals), and so are, at load, ``pickle`` objects and ``torch`` bytes naming such globals
  (naming the key and the checkpoint): the payload never runs;
* ``ObjectPolicy``: a class allowed with ``safe_globals`` saves and loads; ``trust=True`` loads
  anything, with one ``TrustedObjectWarning`` per policy;
* ``load_torch`` refuses compressed zip records (which ``torch.save`` never writes);
* bytes that are no ``torch.save`` data at all are an ``IntegrityError`` naming the key.

Pure: bytes in, values out; no service.
"""

from __future__ import annotations

import collections
import io
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd_schemas.errors import IntegrityError, InvalidRequest, UnsafeObject
from ckptd_schemas.format.objects import (
    SAFE, ObjectPolicy, TrustedObjectWarning, UnsafeData, check_payload, decode_object, encode_object, json_exact,
    load_dcp_file_metadata, load_torch, reencode_for_dcp,
)
from ckptd_schemas.manifest import ObjectEntry

LOC = {"file": "r0.bin", "offset": 0, "length": 1, "raw_length": 1, "xxh3": "0" * 16}


@dataclass
class Point:
    """Plain data: harmless to build from untrusted fields, once a client allows it."""

    x: int
    y: float


class Touches:
    """Unpickling it creates a file: the stand-in for a payload that runs code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _entry(encoding: str, key: str = "extra.state") -> ObjectEntry:
    return ObjectEntry(name=key, encoding=encoding, location=LOC)


def _torch_bytes(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# -- what is stored as JSON ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, True, 0, -(2**70), 1.5, "ü", [], {}, {"a": [1, {"b": None}]}])
def test_values_json_gives_back_exactly_are_json(value):
    assert json_exact(value)
    enc = encode_object("k", value)
    assert (enc.encoding, enc.value, enc.payload) == ("json", value, None)


def _deep(n: int) -> list:
    v: list = []
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize("value", [(1, 2), {1: "int key"}, {"a": (1,)}, float("nan"), float("inf"), {"s": {1, 2}},
                                   b"bytes", "\ud800", {"\ud800": 1}, collections.OrderedDict(a=1),
                                   np.float64(1.0), _deep(5_000)], ids=lambda v: type(v).__name__)
def test_values_json_would_change_are_not_json(value):
    assert not json_exact(value)


def test_a_self_referencing_value_is_not_json():
    v: list = []
    v.append(v)
    assert not json_exact(v)


# -- stored as torch bytes, read back under the allow-list ---------------------------------------------------

@pytest.mark.parametrize("value", [
    (1, "two", 3.0), collections.OrderedDict(b=1, a=2), {"t": torch.arange(4)}, {1: "int key"}, float("nan"),
    np.random.RandomState(0).get_state(), np.arange(3.0), {"s": {1, 2}}, torch.Size([2, 3]),
], ids=lambda v: type(v).__name__)
def test_other_plain_values_round_trip_as_torch_bytes_without_opt_in(value):
    enc = encode_object("extra.state", value)
    assert enc.encoding == "torch" and enc.payload
    got = decode_object(_entry("torch"), enc.payload, ref="gpt/1")
    assert type(got) is type(value)
    assert repr(got) == repr(value) or all(np.array_equal(a, b) for a, b in zip(got, value))


def test_json_objects_decode_to_their_inline_value():
    assert decode_object(ObjectEntry(name="cfg", encoding="json", value={"lr": 0.1}), None) == {"lr": 0.1}


def test_an_unsafe_value_is_refused_at_save_naming_the_key(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeObject) as info:
        encode_object("extra.hook", Touches(marker))
    e = info.value
    assert "object 'extra.hook'" in e.message and e.details["key"] == "extra.hook"
    assert any("open" in g for g in e.details["globals"])
    with pytest.raises(UnsafeObject, match="object 'extra.p'"):
        encode_object("extra.p", Point(1, 2.0))  # a class nobody allowed
    assert not marker.exists()


def test_a_value_that_cannot_be_serialised_is_an_invalid_request_naming_the_key():
    with pytest.raises(InvalidRequest) as info:
        encode_object("extra.fn", lambda: 1)
    assert not isinstance(info.value, UnsafeObject)
    assert "object 'extra.fn'" in info.value.message and info.value.details == {"key": "extra.fn"}


def test_a_class_the_client_allows_saves_and_loads_under_that_policy_only():
    allowed = ObjectPolicy.of(safe_globals=[Point])
    enc = encode_object("extra.p", Point(1, 2.5), allowed)
    assert enc.encoding == "torch"
    assert decode_object(_entry("torch", "extra.p"), enc.payload, policy=allowed) == Point(1, 2.5)
    with pytest.raises(UnsafeObject) as info:  # a default client did not allow it
        decode_object(_entry("torch", "extra.p"), enc.payload, ref="gpt/3")
    assert "object 'extra.p' of gpt/3" in info.value.message
    assert info.value.details["ref"] == "gpt/3" and info.value.details["encoding"] == "torch"
    assert any("Point" in g for g in info.value.details["globals"])
    # the allow-list was for that one load: it is not left in torch's process-wide list
    assert Point not in torch.serialization.get_safe_globals()


# -- at load: nothing runs without trust ------------------------------------------------------------------

def test_torch_bytes_that_would_run_code_are_refused_and_do_not_run(tmp_path):
    marker = tmp_path / "ran"
    data = _torch_bytes({"ok": 1, "hook": Touches(marker)})
    with pytest.raises(UnsafeObject) as info:
        decode_object(_entry("torch"), data, ref="gpt/1")
    assert "object 'extra.state' of gpt/1" in info.value.message
    with pytest.raises(UnsafeObject):
        check_payload("extra.state", data)
    with pytest.raises(UnsafeObject):
        reencode_for_dcp(_entry("torch"), data, ref="gpt/1")
    assert not marker.exists()


def test_pickle_objects_are_refused_without_trust(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(Touches(marker))
    with pytest.raises(UnsafeObject) as info:
        decode_object(_entry("pickle", "rng"), data, ref="gpt/2")
    assert "object 'rng' of gpt/2: it is stored as pickle" in info.value.message
    assert info.value.details["encoding"] == "pickle" and info.value.details["key"] == "rng"
    harmless = pickle.dumps({"seed": 1})  # even a harmless one: pickle is never read restricted
    with pytest.raises(UnsafeObject):
        decode_object(_entry("pickle", "rng"), harmless)
    assert not marker.exists()


def test_trust_loads_anything_and_warns_once_per_policy(tmp_path):
    with pytest.warns(TrustedObjectWarning):
        trusting = ObjectPolicy.of(trust=True)
    marker = tmp_path / "ran"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the policy warned already: loads do not warn again
        assert decode_object(_entry("pickle"), pickle.dumps({"seed": 1}), policy=trusting) == {"seed": 1}
        got = decode_object(_entry("torch"), _torch_bytes(Touches(marker)), policy=trusting)
    got.close()
    assert marker.exists()  # trusted: the unrestricted unpickler ran it
    fresh = ObjectPolicy(trust=True)  # built without .of(): the first load warns
    with pytest.warns(TrustedObjectWarning, match="object 'rng'"):
        decode_object(_entry("pickle", "rng"), pickle.dumps(1), policy=fresh)


def test_a_trusting_policy_stores_unsafe_values_with_a_warning(tmp_path):
    policy = ObjectPolicy(trust=True)
    with pytest.warns(TrustedObjectWarning, match="object 'extra.p'"):
        enc = encode_object("extra.p", Point(1, 2.0), policy)
    assert enc.encoding == "torch"
    data = _torch_bytes(Point(1, 2.0))
    assert reencode_for_dcp(_entry("torch"), data, policy=policy) is data  # trusted: handed on as stored


def test_reencode_for_dcp_gives_bytes_a_restricted_load_reads():
    data = reencode_for_dcp(ObjectEntry(name="cfg", encoding="json", value={"a": [1, 2]}), None)
    assert torch.load(io.BytesIO(data), weights_only=True) == {"a": [1, 2]}


@pytest.mark.parametrize("cut", ["half", "empty"])
def test_bytes_that_are_not_torch_data_are_an_integrity_error_naming_the_key(cut):
    data = _torch_bytes({"a": torch.zeros(100)})
    data = data[:len(data) // 2] if cut == "half" else b""
    with pytest.raises(IntegrityError) as info:
        decode_object(_entry("torch", "extra.blob"), data, ref="gpt/4")
    assert not isinstance(info.value, UnsafeObject)
    assert "object 'extra.blob' of gpt/4: its torch.save data cannot be decoded" in info.value.message
    assert info.value.details == {"key": "extra.blob", "ref": "gpt/4"}


def test_an_unknown_encoding_is_an_invalid_request():
    entry = ObjectEntry.model_construct(name="x", encoding="yaml", value=None, location=None, rank=None)
    with pytest.raises(InvalidRequest, match="object 'x': unknown encoding 'yaml'"):
        decode_object(entry, b"")


# -- load_torch and DCP metadata -------------------------------------------------------------------------

def test_a_zip_with_compressed_records_is_refused_before_torch_reads_it():
    stored = _torch_bytes({"a": torch.zeros(4)})
    assert torch.equal(load_torch(io.BytesIO(stored), allowed=())["a"], torch.zeros(4))
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(stored)) as src, zipfile.ZipFile(deflated, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    deflated.seek(0)
    with pytest.raises(UnsafeData, match="compressed zip records"):
        load_torch(deflated, allowed=())
    with pytest.raises(UnsafeObject, match="object 'extra.state'.*compressed zip records"):
        decode_object(_entry("torch"), deflated.getvalue())


def test_dcp_file_metadata_is_read_with_dcps_classes_only(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                    torch.Size([2]), [])})
    got = load_dcp_file_metadata(io.BytesIO(pickle.dumps(meta)))
    assert got.state_dict_metadata["w"].size == torch.Size([2])
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="is not one of DCP's metadata classes"):
        load_dcp_file_metadata(io.BytesIO(pickle.dumps(Touches(marker))))
    assert not marker.exists()


def test_the_default_policy_trusts_nothing():
    assert SAFE.trust is False and SAFE.safe_globals == ()
    assert np.ndarray in SAFE.allowed  # numpy's state (np.random.get_state()) loads without opt-in
