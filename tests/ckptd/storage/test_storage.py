"""Conformance suite for the storage interface (``ckptd.storage``).

Every backend must behave the same through :class:`ckptd.storage.Storage`:
LocalStorage on a directory (and on a ``file://`` URL), FsspecStorage on ``memory://``,
and S3Storage on ``s3://`` against a real S3 protocol server on loopback
(moto in server mode, started by the ``moto_s3`` fixture; more S3 cases in
test_s3.py). A few local-only cases (disk full) follow at the end.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest

from ckptd.storage import LocalStorage, Storage, open_storage
from ckptd.storage.fsspec import FsspecStorage
from ckptd.storage.s3 import S3Storage
from ckptd.store.rereads import mark_due
from ckptd_schemas import InvalidName, StorageError
from s3_server import pending_uploads

BACKENDS = ["local", "file-url", "fsspec-memory", "s3"]


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path):
    if request.param == "local":
        yield LocalStorage(tmp_path / "root", durable=True)
    elif request.param == "file-url":
        yield open_storage("file://" + str(tmp_path / "root"))
    elif request.param == "s3":
        moto = request.getfixturevalue("moto_s3")
        request.getfixturevalue("s3_env")  # endpoint and credentials from the standard AWS environment
        st = open_storage(moto.url())
        assert isinstance(st, S3Storage)
        yield st
        moto.clear(st._prefix)
    else:
        st = FsspecStorage(f"memory://ckptd-test-{uuid.uuid4().hex}")
        yield st
        try:
            st.fs.rm(st.root, recursive=True)
        except FileNotFoundError:
            pass


def raw_names(st: Storage, prefix: str) -> list[str]:
    """Every entry under ``prefix`` as the backend sees it (temp and hidden files included)."""
    if isinstance(st, LocalStorage):
        path = st.root.joinpath(*prefix.split("/")) if prefix else st.root
        return sorted(os.listdir(path)) if path.is_dir() else []
    assert isinstance(st, (FsspecStorage, S3Storage))  # each with its fsspec filesystem (``fs``) and ``root``
    path = f"{st.root}/{prefix}" if prefix else st.root
    if not st.fs.exists(path):
        names = []
    else:
        names = sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in st.fs.ls(path, detail=False, refresh=True))
    if isinstance(st, S3Storage):  # unfinished multipart uploads are storage left behind too
        depth = prefix.count("/") + 1 if prefix else 0
        names += [f"{k.split('/')[depth]} (upload in flight)" for k in pending_uploads(st, prefix)]
    return names


# -- basic objects -------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 1024 * 1024 + 7])
def test_put_read_size(storage, n):
    data = os.urandom(n)
    storage.put("run/ckpt/data-0", data)
    assert storage.read("run/ckpt/data-0") == data
    assert storage.size("run/ckpt/data-0") == n
    assert storage.exists("run/ckpt/data-0")


def test_ranged_reads(storage):
    data = os.urandom(10_000)
    storage.put("f", data)
    for start, end in [(0, 0), (0, 1), (1, 2), (4095, 4097), (123, 9_999), (0, 10_000), (9_999, 10_000), (5000, 5000)]:
        assert storage.read("f", start, end) == data[start:end], (start, end)
    assert storage.read("f", 7_000) == data[7_000:]
    assert storage.read("f", 0, None) == data


def test_streamed_writes_and_overwrite(storage):
    chunks = [os.urandom(1000) for _ in range(5)]
    w = storage.open_write("a/s")
    for c in chunks:
        w.write(c)
    assert storage.size("a/s") is None  # nothing at the key before the commit
    w.commit()
    assert storage.read("a/s") == b"".join(chunks)
    storage.put("a/s", b"second")  # commit replaces the previous object
    assert storage.read("a/s") == b"second"
    assert storage.size("a/s") == 6


def test_size_of_missing_is_none(storage):
    assert storage.size("nope") is None
    assert storage.size("no/such/key") is None
    assert not storage.exists("nope")


def test_read_missing_names_key(storage):
    with pytest.raises(StorageError) as ei:
        storage.read("run/ckpt/missing-file")
    assert "run/ckpt/missing-file" in ei.value.message
    assert ei.value.details.get("key") == "run/ckpt/missing-file"
    with pytest.raises(StorageError) as ei:
        storage.read("run/ckpt/missing-file", 10, 20)
    assert "run/ckpt/missing-file" in ei.value.message


def test_read_json(storage):
    storage.put("j/ok.json", b'{"a": [1, 2]}')
    assert storage.read_json_or_none("j/ok.json") == {"a": [1, 2]}
    assert storage.read_json_or_none("j/absent.json") is None
    storage.put("j/bad.json", b"{not json")
    with pytest.raises(StorageError) as ei:
        storage.read_json_or_none("j/bad.json")
    assert "j/bad.json" in ei.value.message


# -- listing -------------------------------------------------------------------


def test_list_immediate_children_sorted(storage):
    for key in ["r/b/x", "r/a", "r/c/d/e", "r/C", "r/0", "other/z"]:
        storage.put(key, b"1")
    assert storage.list("r") == ["0", "C", "a", "b", "c"]
    assert storage.list("r/c") == ["d"]
    assert storage.list("r/c/d") == ["e"]
    assert storage.list("") == ["other", "r"]
    assert storage.list("missing") == []
    assert storage.list("missing/deeper") == []


def test_list_hides_temp_files(storage):
    storage.put("d/visible", b"v")
    w = storage.open_write("d/pending")
    w.write(b"partial")
    assert storage.list("d") == ["visible"]
    w.commit()
    assert storage.list("d") == ["pending", "visible"]
    w2 = storage.open_write("d/third")
    w2.write(b"x")
    assert storage.list("d") == ["pending", "visible"]
    w2.abort()
    # create_if_absent's own temporaries are never listed either
    assert storage.create_if_absent("d/marker", b"m")
    assert storage.list("d") == ["marker", "pending", "visible"]
    assert raw_names(storage, "d") == ["marker", "pending", "visible"]


def test_walk_gives_every_stored_key_and_its_size(storage):
    """``walk``: what ``verify`` compares with a manifest. An unfinished write's temp file is walked
    (it takes space in the checkpoint's directory, though ``list`` hides it), and on a local root
    reclaimed; an object store's is no object (buffered, or an unfinished multipart upload)."""
    stored = [("w/a", 1), ("w/b/c", 2), ("w/b/d/e", 3)]
    for key, n in [*stored, ("x/y", 4)]:
        storage.put(key, b"1" * n)
    assert storage.walk("w") == stored
    assert storage.walk("w/b/d") == [("w/b/d/e", 3)]
    assert storage.walk("missing") == []
    w = storage.open_write("w/pending")
    w.write(b"partial")
    temp = [k for k, _ in storage.walk("w") if k not in dict(stored)]
    if isinstance(storage, S3Storage):
        assert temp == []
    else:
        assert len(temp) == 1 and temp[0].startswith(("w/.pending.tmp-", "w/pending.tmp-")), temp
    if isinstance(storage, LocalStorage) or getattr(storage, "_local", None) is not None:
        assert storage.reclaim_temps("w", math.inf) == 1 and storage.walk("w") == stored
    w.abort()
    assert storage.walk("w") == stored


# -- writers -------------------------------------------------------------------


def test_writer_not_visible_before_commit(storage):
    w = storage.open_write("ck/data-1")
    w.write(b"a" * 5000)
    w.write(memoryview(b"b" * 5000))
    assert storage.size("ck/data-1") is None
    assert not storage.exists("ck/data-1")
    assert "data-1" not in storage.list("ck")
    with pytest.raises(StorageError):
        storage.read("ck/data-1")
    w.commit()
    assert storage.read("ck/data-1") == b"a" * 5000 + b"b" * 5000


def test_writer_does_not_replace_before_commit(storage):
    storage.put("ck/obj", b"old")
    w = storage.open_write("ck/obj")
    w.write(b"new-content")
    assert storage.read("ck/obj") == b"old"
    w.commit()
    assert storage.read("ck/obj") == b"new-content"


def test_abort_leaves_nothing(storage):
    w = storage.open_write("ab/sub/obj")
    w.write(os.urandom(10_000))
    w.abort()
    w.abort()  # idempotent
    assert storage.size("ab/sub/obj") is None
    assert storage.list("ab/sub") == []
    assert raw_names(storage, "ab/sub") == []


def test_abort_keeps_previous_object(storage):
    storage.put("ab/obj", b"committed")
    w = storage.open_write("ab/obj")
    w.write(b"doomed")
    w.abort()
    assert storage.read("ab/obj") == b"committed"
    assert raw_names(storage, "ab") == ["obj"]


def test_an_aborted_writer_leaves_nothing(storage):
    w = storage.open_write("cm/ok")
    w.write(b"ok")
    w.commit()
    assert storage.read("cm/ok") == b"ok"
    w = storage.open_write("cm/failed")
    w.write(b"half")
    w.abort()  # the producer died
    w.abort()
    assert storage.size("cm/failed") is None
    assert raw_names(storage, "cm") == ["ok"]


# -- create_if_absent ----------------------------------------------------------


def test_create_if_absent_once(storage):
    assert storage.create_if_absent("run/ck/COMMITTED", b"first") is True
    assert storage.create_if_absent("run/ck/COMMITTED", b"second") is False
    assert storage.read("run/ck/COMMITTED") == b"first"
    assert raw_names(storage, "run/ck") == ["COMMITTED"]


def test_create_if_absent_existing_put(storage):
    storage.put("m", b"already")
    assert storage.create_if_absent("m", b"other") is False
    assert storage.read("m") == b"already"


def test_create_if_absent_concurrent(storage):
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[int, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            barrier.wait()
            created = storage.create_if_absent("race/COMMITTED", f"writer-{i}".encode() * 100)
            with lock:
                results.append((i, created))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    winners = [i for i, created in results if created]
    assert len(results) == n
    assert len(winners) == 1, results
    assert storage.read("race/COMMITTED") == f"writer-{winners[0]}".encode() * 100
    assert raw_names(storage, "race") == ["COMMITTED"]


# -- delete --------------------------------------------------------------------


def test_delete(storage):
    storage.put("del/a", b"1")
    storage.put("del/b", b"2")
    storage.delete("del/a")
    assert storage.size("del/a") is None
    assert storage.read("del/b") == b"2"
    storage.delete("del/a")  # absent is fine
    storage.delete("never/existed")
    assert storage.list("del") == ["b"]


def test_delete_tree(storage):
    for key in ["t/x/1", "t/x/2", "t/x/y/3", "t/keep", "tx/other"]:
        storage.put(key, b"d")
    storage.delete_tree("t/x")
    assert storage.size("t/x/1") is None
    assert storage.size("t/x/y/3") is None
    assert storage.list("t/x") == []
    assert storage.list("t") == ["keep"]
    assert storage.read("tx/other") == b"d"  # a sibling with the same prefix string survives
    storage.delete_tree("t/x")  # absent is fine
    storage.delete_tree("no/such/tree")
    storage.delete_tree("t")
    assert storage.list("") == ["tx"]



def test_delete_if_empty_removes_a_folder_only_when_it_holds_nothing(storage):
    """What a finished re-read leaves (``reread/<run>`` once its last entry is deleted) goes on a local
    root; on every backend nothing held goes with it (an object store has no folders to remove)."""
    for key in ["e/r/n1/DUE", "e/r/n2/DUE", "e/file"]:
        storage.put(key, b"d")
    storage.delete_tree("e/r/n1")
    for prefix in ("e/r/n1", "e/r", "e/file", "no/such"):  # absent, holding n2, an object: nothing goes
        storage.delete_if_empty(prefix)
    assert storage.read("e/r/n2/DUE") == b"d" and storage.read("e/file") == b"d"
    storage.delete_tree("e/r/n2")
    storage.delete_if_empty("e/r")
    if isinstance(storage, (LocalStorage, S3Storage)):
        assert storage.list("e") == ["file"] and raw_names(storage, "e") == ["file"]


# -- unsafe keys ---------------------------------------------------------------

UNSAFE = ["..", "../x", "a/../b", "a/..", "/abs", "/etc/passwd", "a//b", "a/./b", ".", "./a", "a/", "a\\b", "a\x00b"]


def test_walk_sizes_the_objects_under_a_prefix_and_free_space_is_the_local_disks(storage):
    """What the store measures a writer's holding and the root's reserve with (ckptd.store.space)."""
    storage.put("runs/a/1/x.bin", b"x" * 5000)
    storage.put("runs/a/2/sessions/s/y.bin", b"y" * 300)
    storage.put("runs/ab/1/z.bin", b"z" * 7)
    def usage(prefix: str) -> int:
        return sum(size for _, size in storage.walk(prefix))

    assert usage("runs/a") == 5300 and usage("runs/ab") == 7 and usage("runs/none") == 0
    fs = storage.free_space()
    if isinstance(storage, LocalStorage):
        free, total = fs
        assert 0 <= free <= total and total > 0
    else:
        assert fs is None  # an object store: no disk to fill


@pytest.mark.parametrize("key", UNSAFE)
def test_unsafe_keys_refused(storage, key):
    ops = {
        "read": lambda: storage.read(key),
        "ranged read": lambda: storage.read(key, 0, 1),
        "size": lambda: storage.size(key),
        "exists": lambda: storage.exists(key),
        "put": lambda: storage.put(key, b"x"),
        "open_write": lambda: storage.open_write(key),
        "create_if_absent": lambda: storage.create_if_absent(key, b"x"),
        "delete": lambda: storage.delete(key),
        "delete_tree": lambda: storage.delete_tree(key),
        "list": lambda: storage.list(key),
    }
    for op, fn in ops.items():
        with pytest.raises(InvalidName) as ei:
            fn()
        assert ei.value.status == 400, op
    assert raw_names(storage, "") == []


def test_empty_key_refused(storage):
    for fn in (lambda: storage.put("", b"x"), lambda: storage.read(""), lambda: storage.create_if_absent("", b"x")):
        with pytest.raises((InvalidName, StorageError)):
            fn()


def test_open_storage_dispatch(tmp_path):
    assert isinstance(open_storage(str(tmp_path / "a")), LocalStorage)
    st = open_storage("file://" + str(tmp_path / "b"))
    assert isinstance(st, LocalStorage)  # a file:// root is a local one, whichever way it is named
    assert isinstance(open_storage("memory://ckptd-dispatch"), FsspecStorage)
    st.put("k", b"v")
    assert (tmp_path / "b" / "k").read_bytes() == b"v"


def test_file_url_and_local_share_layout(tmp_path):
    """A root opened both ways sees the same objects (service on a path, CLI on a URL)."""
    local = LocalStorage(tmp_path / "root")
    url = open_storage("file://" + str(tmp_path / "root"))
    local.put("r/c/manifest.json", b"{}")
    assert url.read("r/c/manifest.json") == b"{}"
    assert url.create_if_absent("r/c/COMMITTED", b"m")
    assert not local.create_if_absent("r/c/COMMITTED", b"other")
    assert local.list("r/c") == url.list("r/c") == ["COMMITTED", "manifest.json"]


# -- local only: disk full -----------------------------------------------------


def test_local_enospc_from_the_os_write(tmp_path, monkeypatch):
    """ENOSPC from the OS's write (the disk fills after 10,000 bytes) becomes StorageError('... disk
    full') and leaves no temp file, whether it comes from a window written past the page cache or from
    the buffered tail (test_local_enospc_real_tmpfs fills a real filesystem)."""
    st = LocalStorage(tmp_path / "root")
    room = [10_000]
    real_write = os.write

    def full_write(fd, data):
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, memoryview(data)[:room[0]])
        room[0] -= n
        return n

    monkeypatch.setattr(os, "write", full_write)
    w = st.open_write("run/ck/data-0")
    with pytest.raises(StorageError) as ei:
        w.write(os.urandom(9 << 20))  # two whole windows and more
        w.commit()
    assert "disk full" in ei.value.message
    assert "run/ck/data-0" in ei.value.message
    assert ei.value.details.get("errno") == errno.ENOSPC
    assert st.size("run/ck/data-0") is None
    assert raw_names(st, "run/ck") == []



def test_a_local_write_whose_folders_are_removed_before_its_file_opens_makes_them_again(tmp_path, monkeypatch):
    """A writer makes its key's folders, then opens its temp file there; a concurrent
    ``delete_if_empty`` (a re-read of the run's last other entry finishing) may remove them in between.
    The write makes them again and succeeds; nothing else is written."""
    st = LocalStorage(tmp_path / "root")
    real_open = os.open
    removed: list[str] = []

    def racing_open(path, flags, *args, **kwargs):
        if not removed and ".DUE.tmp-" in str(path):  # the folders made, the temp file not yet open
            for prefix in ("reread/r/2/s1", "reread/r/2", "reread/r"):
                st.delete_if_empty(prefix)
                removed.append(prefix)
            assert not (st.root / "reread" / "r").exists()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    mark_due(st, "r", "2", "s1")
    assert removed and st.read_json_or_none("reread/r/2/s1/DUE")["at"] > 0
    assert raw_names(st, "reread/r/2/s1") == ["DUE"]


def _unshare_works() -> bool:
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        return False
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k none /tmp"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_local_enospc_real_tmpfs(tmp_path):
    """A real full filesystem: a 64 KiB tmpfs mounted in a private mount namespace (unshare -rm)."""
    if not _unshare_works():
        pytest.skip("cannot mount a private tmpfs here (unshare -rm unavailable)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = textwrap.dedent(
        """
        import os, sys
        from ckptd.storage import LocalStorage
        from ckptd_schemas import StorageError
        st = LocalStorage(sys.argv[1])
        st.put("small", b"fits")
        out = []
        try:
            st.put("run/ck/data-0", os.urandom(1 << 20))
            out.append("put: no error")
        except StorageError as e:
            out.append("put: " + e.message)
        w = st.open_write("run/ck/data-1")
        try:
            for _ in range(64):
                w.write(os.urandom(64 << 10))
            w.commit()
            out.append("writer: no error")
        except StorageError as e:
            out.append("writer: " + e.message)
        try:
            st.create_if_absent("run/ck/COMMITTED", os.urandom(1 << 20))
            out.append("create: no error")
        except StorageError as e:
            out.append("create: " + e.message)
        leftovers = sorted(os.listdir(os.path.join(sys.argv[1], "run", "ck")))
        out.append("left: " + repr(leftovers))
        out.append("small: " + st.read("small").decode())
        print("\\n".join(out))
        """
    )
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k none "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(mnt), sys.executable, script],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    for what in ("put", "writer", "create"):
        assert "disk full" in lines[what], r.stdout
    assert "run/ck/data-0" in lines["put"]
    assert "run/ck/data-1" in lines["writer"]
    assert "run/ck/COMMITTED" in lines["create"]
    assert lines["left"] == "[]", r.stdout
    assert lines["small"] == "fits"


def test_read_into_fills_a_callers_buffer_like_read(storage):
    data = bytes(range(256)) * 64
    storage.put("a/blob", data)
    buf = bytearray(1000)
    assert storage.read_into("a/blob", 300, memoryview(buf)) == 1000
    assert bytes(buf) == data[300:1300]
    tail = bytearray(500)
    assert storage.read_into("a/blob", len(data) - 200, memoryview(tail)) == 200  # short at the end
    assert bytes(tail[:200]) == data[-200:]
    with pytest.raises(StorageError, match="a/missing"):
        storage.read_into("a/missing", 0, memoryview(bytearray(4)))


def test_a_local_link_under_a_stamp_the_source_no_longer_has_links_nothing(tmp_path):
    """A hard link is kept only on the inode, size and mtime the stamp names: a source edited after its
    stamp was taken, even with its mtime put back, or replaced, is not linked."""
    import os

    from ckptd.storage import open_storage

    st = open_storage(str(tmp_path / "root"))
    st.put("ln/src", b"checked bytes")
    checked, path = st.stamp("ln/src"), tmp_path / "root" / "ln" / "src"
    before = os.stat(path)
    path.write_bytes(b"other bytes!!")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the ctime moved
    assert st.link("ln/src", "ln/a", checked) is False and not st.exists("ln/a")
    st.delete("ln/src")
    st.put("ln/src", b"checked bytes")  # the same bytes again: another inode
    assert st.link("ln/src", "ln/b", checked) is False and not st.exists("ln/b")
    assert st.link("ln/src", "ln/c", st.stamp("ln/src")) is True and st.read("ln/c") == b"checked bytes"
