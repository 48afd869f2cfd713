"""Permanent storage failures (``ckptd.storage.failures``): which ones no retry changes, and what they become.

The classification table is checked on the exceptions backends really raise (OS errors with their
errno; an ``s3fs`` translation of a real botocore ``ClientError``), then on real filesystems: a
read-only bind mount (EROFS, even as root) and a root-owned directory written by an unprivileged
process (EACCES). Both need root; they skip otherwise. The service-level behaviour (507 at session
open, ``/readyz``, loads) is in tests/system/test_unwritable_root.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ckptd.storage import LocalStorage, open_storage
from ckptd.storage.failures import permanent_error
from ckptd_schemas import (
    StorageError, StorageFull, StoragePermanent, StorageReadOnly, error_from_body,
)
from support import REPO, as_user, read_only_view

NOBODY = 65534


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code), "/srv/ckpt/runs/r/1/x")


@pytest.mark.parametrize(("code", "op", "cls"), [
    (errno.ENOSPC, "write", StorageFull),
    (errno.EDQUOT, "commit", StorageFull),
    (errno.EROFS, "create", StorageReadOnly),
    (errno.EROFS, "delete", StorageReadOnly),
    (errno.EACCES, "open", StorageReadOnly),
    (errno.EPERM, "link", StorageReadOnly),
    (errno.EACCES, "read", StoragePermanent),
    (errno.EPERM, "list", StoragePermanent),
    (errno.EACCES, "stat", StoragePermanent),
])
def test_an_errno_that_waiting_will_not_change_is_permanent_and_names_the_root(code, op, cls):
    err = permanent_error(op, "runs/r/1/x", _os_error(code), "/srv/ckpt")
    assert type(err) is cls, err
    assert isinstance(err, StorageError) and err.status == 507  # not in the client's retried statuses
    assert err.details == {"key": "runs/r/1/x", "root": "/srv/ckpt", "errno": code}
    assert "runs/r/1/x" in err.message and "/srv/ckpt" in err.message
    if cls is not StorageFull:
        assert errno.errorcode[code] in err.message  # the cause, by name
    # Through the wire: the same class, so `except StorageReadOnly` works on the client.
    back = error_from_body(json.loads(json.dumps(err.to_body())), err.status)
    assert type(back) is cls and back.details == err.details


@pytest.mark.parametrize("code", [errno.EIO, errno.ECONNRESET, errno.EAGAIN, errno.ETIMEDOUT, errno.ENOENT])
def test_other_errnos_stay_transient(code):
    assert permanent_error("write", "k", _os_error(code), "/srv/ckpt") is None
    assert permanent_error("write", "k", RuntimeError("connection pool full"), "/srv/ckpt") is None


def test_a_cause_deep_in_the_chain_counts_and_a_bare_permission_error_is_eacces():
    try:
        try:
            raise _os_error(errno.EROFS)
        except OSError as inner:
            raise RuntimeError("the backend's own wrapper") from inner
    except RuntimeError as outer:
        assert isinstance(permanent_error("write", "k", outer, "/r"), StorageReadOnly)
    denied = PermissionError("Forbidden")  # a backend's translation of a 403, without an errno
    err = permanent_error("write", "k", denied, "gs://bucket/ckpt")
    assert isinstance(err, StorageReadOnly) and err.details["errno"] == errno.EACCES
    assert "credentials" in err.message and "gs://bucket/ckpt" in err.message


def test_s3_refusals_are_permanent_and_throttling_is_not():
    botocore = pytest.importorskip("botocore.exceptions")
    s3errors = pytest.importorskip("s3fs.errors")

    def translated(code: str, status: int) -> BaseException:
        e = botocore.ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                                  "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        return s3errors.translate_boto_error(e)  # what s3fs raises to the backend

    for code, status in (("AccessDenied", 403), ("InvalidAccessKeyId", 403), ("SignatureDoesNotMatch", 403),
                         ("403", 403)):
        w = permanent_error("commit", "runs/r/1/x", translated(code, status), "s3://b/ckpt")
        r = permanent_error("read", "runs/r/1/x", translated(code, status), "s3://b/ckpt")
        assert type(w) is StorageReadOnly and type(r) is StoragePermanent, (code, w, r)
        assert w.details["s3_code"] == code and "s3://b/ckpt" in w.message and code in w.message
    for code, status in (("SlowDown", 503), ("InternalError", 500), ("RequestTimeout", 400)):
        assert permanent_error("commit", "k", translated(code, status), "s3://b/ckpt") is None, code


def test_read_only_mount_refuses_writes_at_once_and_still_reads(tmp_path):
    src = tmp_path / "src"
    LocalStorage(src).put("runs/r/1/data", b"committed bytes")
    unmount = read_only_view(src, tmp_path / "ro")
    try:
        for st in (LocalStorage(tmp_path / "ro"), open_storage("file://" + str(tmp_path / "ro"))):
            root = str((tmp_path / "ro").resolve())
            assert st.read("runs/r/1/data") == b"committed bytes"
            assert st.list("runs/r") == ["1"]
            st.delete("runs/r/1/absent")  # absent is fine, even where the filesystem refuses to look (EROFS)
            for what, call in (("put", lambda: st.put("runs/r/2/data", b"x")),
                               ("create", lambda: st.create_if_absent("runs/r/1/COMMITTED", b"m")),
                               ("create at the root", lambda: st.create_if_absent(".probe", b"m")),
                               ("delete", lambda: st.delete("runs/r/1/data"))):
                with pytest.raises(StorageReadOnly) as ei:
                    call()
                err = ei.value
                assert err.details["errno"] == errno.EROFS and err.details["root"] == root, (what, err.details)
                assert f"the storage root {root} is read-only" in err.message, (what, err.message)
            assert st.read("runs/r/1/data") == b"committed bytes"
        assert sorted(os.listdir(src)) == ["runs"]  # nothing left behind (no temp of the refused writes)
    finally:
        unmount()


def test_a_root_the_services_user_may_not_write_is_read_only_to_it():
    """A root-owned directory (as a bind mount into a container is) written by an unprivileged process."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another user needs root")
    base = Path(tempfile.mkdtemp(prefix="ckptd-owned-", dir="/tmp"))  # not under pytest's 0700 directory
    try:
        base.chmod(0o755)
        LocalStorage(base / "root").put("runs/r/1/data", b"committed bytes")
        script = textwrap.dedent("""
            import json, sys
            from ckptd.storage import LocalStorage
            from ckptd_schemas import StorageError
            st = LocalStorage(sys.argv[1])
            out = {"read": st.read("runs/r/1/data").decode()}
            for what, call in (("put", lambda: st.put("runs/r/2/data", b"x")),
                               ("create", lambda: st.create_if_absent("runs/r/1/COMMITTED", b"m"))):
                try:
                    call()
                    out[what] = "no error"
                except StorageError as e:
                    out[what] = [type(e).__name__, e.message, e.details]
            print(json.dumps(out))
            """)
        r = subprocess.run(as_user(NOBODY, [sys.executable, "-c", script, str(base / "root")]), capture_output=True,
                           text=True, timeout=120, cwd=REPO, env={**os.environ, "HOME": str(base)})
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert out["read"] == "committed bytes"
        for what in ("put", "create"):
            name, message, details = out[what]
            assert name == "StorageReadOnly", out[what]
            assert details["errno"] == errno.EACCES and details["root"] == str(base / "root")
            assert f"uid {NOBODY}" in message and "EACCES" in message and str(base / "root") in message
    finally:
        shutil.rmtree(base, ignore_errors=True)
