"""``ckptd.storage.base``: the storage interface's derived methods, over the smallest backend it allows.

``MemoryStorage`` below implements only the primitives (a dict of bytes, writes visible on commit),
so what is checked is the base class's own behaviour, which every backend inherits unless it does
better: ``check_key`` refuses keys that could leave the root; ``put`` and a writer's commit or abort
commit whole or leave the previous object; ``read_into``, ``read_or_none``, ``read_json_or_none`` and
``stamp`` derive from the primitives; a committed data file that is absent, resized or read short
is ``CorruptCheckpoint`` at once, while a failing backend with the file whole stays a (retried)
``StorageError``; a backend with no links, temp files or presigned uploads says so.
"""

from __future__ import annotations

import pytest

from ckptd.storage.base import Storage, Writer, check_key
from ckptd_schemas import CorruptCheckpoint, IntegrityError, InvalidName, StorageError


class _MemoryWriter(Writer):
    def __init__(self, st: "MemoryStorage", key: str, once: bool) -> None:
        self.st, self.key, self.once, self.buf, self.closed = st, key, once, bytearray(), False

    def write(self, data) -> None:
        if self.st.fail_writes:
            raise StorageError(f"write of {self.key!r} failed", key=self.key)
        self.buf += data

    def commit(self) -> bool:
        self.closed = True
        if self.once and self.key in self.st.objects:
            return False
        self.st.objects[self.key] = bytes(self.buf)
        return True

    def abort(self) -> None:
        self.closed = True
        self.st.aborted.append(self.key)


class MemoryStorage(Storage):
    """Primitives only: every derived method is the base class's."""

    url = "mem://test"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.aborted: list[str] = []
        self.fail_writes = False
        self.fail_reads = False

    def open_write(self, key: str, *, once: bool = False) -> Writer:
        return _MemoryWriter(self, check_key(key), once)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if self.fail_reads:
            raise StorageError(f"read of {key!r} failed: the backend is down", key=key)
        if key not in self.objects:
            raise StorageError(f"{key!r} not found", key=key)
        return self.objects[key][start:end]

    def size(self, key: str) -> int | None:
        return len(self.objects[key]) if key in self.objects else None

    def list(self, prefix: str) -> list[str]:
        p = prefix.rstrip("/") + "/"
        return sorted({k[len(p):].split("/")[0] for k in self.objects if k.startswith(p)})

    def create_if_absent(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            return False
        self.objects[key] = data
        return True

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def delete_tree(self, prefix: str) -> None:
        for k in [k for k in self.objects if k.startswith(prefix.rstrip("/") + "/")]:
            del self.objects[k]


@pytest.fixture
def st() -> MemoryStorage:
    return MemoryStorage()


# -- keys ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["", "/etc/passwd", "a//b", "a/", "./a", "a/./b", "..", "a/../b", "a/..",
                                 "a\\b", "a\x00b", "runs/r/1/../../../x"])
def test_a_key_that_could_leave_the_root_is_refused(key):
    with pytest.raises(InvalidName) as info:
        check_key(key)
    assert info.value.details == {"field": "key", "value": key}
    assert repr(key) in info.value.message


@pytest.mark.parametrize("key", ["runs/r/1/COMMITTED", "a", "a/.b", "a/b..c", "a/...x"])
def test_a_key_inside_the_root_is_taken(key):
    assert check_key(key) == key


def test_a_long_key_is_named_shortened():
    key = "/" + "k" * 500
    with pytest.raises(InvalidName) as info:
        check_key(key)
    assert info.value.details["value"] == key[:200]


# -- writes ----------------------------------------------------------------------------------------------

def test_put_commits_whole_or_leaves_the_previous_object(st):
    st.put("a/b", b"first")
    assert st.read("a/b") == b"first"
    st.fail_writes = True
    with pytest.raises(StorageError):
        st.put("a/b", b"second")
    assert st.read("a/b") == b"first" and st.aborted == ["a/b"]


def test_a_writer_commits_its_parts_and_an_abort_keeps_the_previous_object(st):
    w = st.open_write("k")
    w.write_parts([b"ab", b"", b"cd"])
    w.write(memoryview(b"ef"))
    w.commit()
    assert st.read("k") == b"abcdef" and st.aborted == []
    w = st.open_write("k")
    w.write(b"half")
    w.abort()  # the request died
    assert st.read("k") == b"abcdef" and st.aborted == ["k"]


# -- derived reads ---------------------------------------------------------------------------------------

def test_read_into_fills_what_there_is(st):
    st.put("k", b"0123456789")
    view = memoryview(bytearray(4))
    assert st.read_into("k", 3, view) == 4 and bytes(view) == b"3456"
    view = memoryview(bytearray(b"xxxxxx"))
    assert st.read_into("k", 7, view) == 3 and bytes(view) == b"789xxx"


def test_presence_and_json(st):
    assert not st.exists("j") and st.read_or_none("j") is None and st.read_json_or_none("j") is None
    assert st.stamp("j") is None
    st.put("j", b'{"a": [1, 2]}')
    assert st.exists("j") and st.read_or_none("j") == b'{"a": [1, 2]}'
    assert st.read_json_or_none("j") == {"a": [1, 2]}
    assert st.stamp("j") == ""  # present, and this backend has no stamp: read the bytes to know
    st.put("bad", b"{not json")
    with pytest.raises(StorageError) as info:
        st.read_json_or_none("bad")
    assert info.value.message.startswith("mem://test/bad is not valid JSON") and info.value.details == {"key": "bad"}


# -- committed data files --------------------------------------------------------------------------------

def test_a_committed_file_read_whole_and_in_part(st):
    st.put("f", bytes(range(100)))
    assert st.read_committed("f", 10, 20, 100) == bytes(range(10, 20))
    view = memoryview(bytearray(5))
    st.read_committed_into("f", 95, view, 100)
    assert bytes(view) == bytes(range(95, 100))
    st.check_committed("f", 100)


def test_a_committed_file_that_is_missing_or_resized_is_corrupt_at_once(st):
    with pytest.raises(CorruptCheckpoint) as info:
        st.check_committed("f", 100, file="r0.bin", tensors=["model.w"])
    assert "committed file 'f' is missing from storage" in info.value.message
    assert info.value.details == {"key": "f", "size": 100, "file": "r0.bin", "tensors": ["model.w"]}
    st.put("f", b"x" * 90)
    with pytest.raises(CorruptCheckpoint) as info:
        st.check_committed("f", 100)
    assert "holds 90 bytes, its manifest says 100" in info.value.message
    assert info.value.details == {"key": "f", "size": 100, "stored_size": 90}
    with pytest.raises(CorruptCheckpoint, match="holds 90 bytes"):  # a read past its end: it was cut short
        st.read_committed("f", 80, 100, 100)
    with pytest.raises(CorruptCheckpoint, match="holds 90 bytes"):
        st.read_committed_into("f", 80, memoryview(bytearray(20)), 100)


def test_a_short_read_of_a_whole_file_is_corrupt(st):
    st.put("f", b"x" * 100)
    with pytest.raises(CorruptCheckpoint, match="gave 10 of the 20 bytes at 90"):  # the range, not the file
        st.read_committed("f", 90, 110, 100)
    with pytest.raises(CorruptCheckpoint, match="gave 10 of the 20 bytes at 90"):
        st.read_committed_into("f", 90, memoryview(bytearray(20)), 100)


def test_a_failing_backend_is_not_damage(st):
    st.put("f", b"x" * 100)
    st.fail_reads = True
    for read in (lambda: st.read_committed("f", 0, 10, 100),
                 lambda: st.read_committed_into("f", 0, memoryview(bytearray(10)), 100)):
        with pytest.raises(StorageError) as info:
            read()
        assert not isinstance(info.value, IntegrityError) and "the backend is down" in info.value.message
    st.delete("f")  # the backend fails and the file is gone too: that is damage
    with pytest.raises(CorruptCheckpoint, match="missing"):
        st.read_committed("f", 0, 10, 100)
    with pytest.raises(CorruptCheckpoint, match="missing"):
        st.read_committed_into("f", 0, memoryview(bytearray(10)), 100)


# -- what a plain backend does not offer -------------------------------------------------------------------

def test_a_plain_backend_offers_no_links_temps_paths_or_presigned_uploads(st):
    st.put("src", b"bytes")
    assert st.link("src", "dst") is False and not st.exists("dst")
    assert st.local_path("src") is None
    assert st.reclaim_temps("", 1e12) == 0
    assert st.presigns is False and st.presign_put("k", 10, 5 << 20, ["A" * 43 + "="], 60.0) is None
    assert st.stored_sha256("src") is None
    with pytest.raises(StorageError) as info:
        st.complete_presigned("k", "upload-1", ["etag"], ["A" * 43 + "="])
    assert info.value.details == {"key": "k"} and "mem://test" in info.value.message
    assert st.read_piece == 1 << 20 and repr(st) == "MemoryStorage('mem://test')"
