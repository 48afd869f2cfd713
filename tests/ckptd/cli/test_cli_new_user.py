"""What a new user met, each answered where it happens with its true reason, in one line, never a traceback.

Through the public surface: ``ckptd`` as a subprocess, a real ``ckptd serve``, real sockets.

* ``rm`` and ``gc`` on a read-only root (a real read-only bind mount: needs root) say that the root
  cannot be written (exit 2), not that no checkpoint of the run verifies;
* ``ls`` and ``show`` mark each checkpoint ``verified``, ``pending`` (no verification recorded) or
  ``known bad`` (with why: ``tests/ckptd/store/test_latest_known_bad.py``), offline and through a
  service, from the one rule (``Visibility.status``), and ``ls --json`` carries the same fields;
* every ``ckptd serve`` flag's mistake is one line naming the flag and what it accepts, exit 2, and
  nothing listens;
* a TLS mismatch (``https://`` to a plain-HTTP service, a certificate not trusted here) and a host
  name that does not resolve are final at once (``Unreachable``): one connection, no retry, although
  the client's budget is minutes; a trusted certificate (``SSL_CERT_FILE``) is reached;
* ``ckptd import dcp`` onto a name that is taken is refused before its source is read (its
  ``.metadata`` is a FIFO no writer opens: reading it would block);
* a key stored as an object but asked for as a tensor, and the other way round, is a
  ``KindMismatch`` naming the key and both kinds, not a missing key.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ckptd_client import (
    CatalogClient, CheckpointClient, KindMismatch, StateDictMismatch, Unavailable, Unreachable,
)
from support import ServerProcess, read_only_view, scaled

#: What every test's client would retry for, were the failure retried: far longer than its hang guard.
BUDGET = scaled(300)
GUARD = scaled(30)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT")}
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=scaled(120), env={**full, **(env or {})})


def _one_line(r: subprocess.CompletedProcess, rc: int) -> str:
    """The refusal's one line, once its exit status and shape are checked."""
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckptd"), r.stderr
    return r.stderr.strip()


def _root(path: Path, *, recorded: bool = True) -> Path:
    """Run ``cli`` with steps 7 and 8, written offline; without ``recorded``, step 7's verification
    record is gone (what a commit whose record could not be written leaves)."""
    from ckptd.storage import open_storage
    from ckptd.store import SessionStore
    from stored_tensors import write_tensors

    sessions = SessionStore(open_storage(str(path)))
    for step in (7, 8):
        write_tensors(sessions, f"cli/{step}", {"model.w": torch.arange(6.0).reshape(2, 3) + step}, step=step)
    if not recorded:
        for step in (7, 8):
            (path / "runs" / "cli" / str(step) / "VERIFIED.json").unlink()
    return path


# -- a read-only root ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recorded", [False, True], ids=["never verified", "verified"])
def test_rm_and_gc_on_a_read_only_root_say_the_root_cannot_be_written(tmp_path, recorded):
    """Never verified: gc must verify before it deletes, and cannot record that; verified: the marker's
    deletion is refused. Either way the one line names the root and that it is read-only (exit 2);
    nothing changes, and a dry run (which writes nothing) still plans."""
    base = Path(tempfile.mkdtemp(prefix="ckptd-ro-", dir="/tmp"))
    undo = lambda: None  # noqa: E731
    try:
        src = _root(base / "src", recorded=recorded)
        undo = read_only_view(src, base / "ro")
        ro = str(base / "ro")
        before = sorted(p.relative_to(src) for p in src.rglob("*"))
        for args in (["rm", "cli/7"], ["gc", "cli", "--keep-last", "1"]):
            line = _one_line(_cli(*args, "--root", ro), 2)
            assert f"the storage root {ro} is read-only" in line and "verif" not in line, line
        assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
        dry = _cli("gc", "cli", "--keep-last", "1", "--dry-run", "--root", ro)
        assert dry.returncode == 0 and "would delete cli/7" in dry.stdout, dry.stdout + dry.stderr
    finally:
        undo()
        shutil.rmtree(base, ignore_errors=True)


# -- ls and show: a checkpoint's status -----------------------------------------------------------------
def test_ls_and_show_mark_each_checkpoint_verified_or_pending_offline_and_through_a_service(tmp_path):
    root = _root(tmp_path / "root", recorded=False)
    from ckptd.store.verification import verify_committed
    from ckptd.storage import open_storage

    assert verify_committed(open_storage(str(root)), "cli", "8").ok  # step 8 verified, step 7 never
    srv = ServerProcess(root).start()
    try:
        for target in (["--root", str(root)], ["--server", srv.url]):
            ls = _cli("ls", "cli", *target)
            assert ls.returncode == 0, ls.stderr
            status = {line.split("\t")[0]: line.split("\t")[3] for line in ls.stdout.splitlines()}
            assert status == {"cli/7": "pending", "cli/8": "verified"}, (target, ls.stdout)
            rows = {r["name"]: r for r in json.loads(_cli("ls", "cli", "--json", *target).stdout)}
            assert (rows["7"]["status"], rows["7"]["status_reason"]) == ("pending", None), rows
            assert rows["8"]["status"] == "verified", rows
            show = _cli("show", "cli/7", *target)
            assert show.returncode == 0 and "status     pending" in show.stdout.splitlines(), show.stdout
            show = _cli("show", "cli/latest", "--json", *target)
            assert json.loads(show.stdout)["name"] == "8" and "cli/8 is verified" in show.stderr, show.stderr
    finally:
        srv.stop()


# -- serve's flags --------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, says", [
    ("--log-level", "loud", "'debug', 'info', 'warning', 'error' or 'critical'"),
    ("--durable", "gs://bucket/prefix", "no storage backend for gs:// here"),
    ("--root", "nosuch://bucket/prefix", "no storage backend for nosuch:// here"),
    ("--log-format", "xml", "invalid choice: 'xml' (choose from 'text', 'json')"),
    ("--port", "abc", "invalid int value: 'abc'"),
    ("--port", "99999", "less than or equal to 65535"),
])
def test_every_serve_flags_mistake_is_one_line_naming_the_flag_and_what_it_accepts(tmp_path, flag, value, says):
    args = ["--root", str(tmp_path / "root"), "--port", "0"]
    line = _one_line(_cli("serve", *args, flag, value), 2)
    assert line.startswith("ckptd serve: ") and flag in line and says in line, line
    if flag in ("--root", "--durable"):  # names what a root may be
        assert "s3://bucket/prefix" in line and "a directory" in line, line
    assert not (tmp_path / "root").exists()  # refused before anything was opened


def test_serve_takes_a_log_level_in_any_case(tmp_path):
    srv = ServerProcess(tmp_path / "root", args=["--log-level", "WARNING"]).start()
    srv.stop()


# -- the client: failures waiting will not change ----------------------------------------------------------
class _Counting(http.server.ThreadingHTTPServer):
    """A real HTTP server on 127.0.0.1 (plain, or TLS with ``context``) answering ``[]`` to every GET,
    counting the connections it accepted."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"[]")

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.context = context
        self.accepted = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def get_request(self):  # type: ignore[no-untyped-def]
        sock, addr = super().get_request()
        self.accepted += 1
        if self.context is not None:
            sock.settimeout(scaled(10))
            try:
                sock = self.context.wrap_socket(sock, server_side=True)
            except (ssl.SSLError, OSError):
                sock.close()
                raise
        return sock, addr

    def handle_error(self, *_: object) -> None:
        pass

    @property
    def url(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.server_address[1]}"


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptd-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def servers(tmp_path) -> Iterator[tuple[_Counting, _Counting, Path]]:
    """A plain-HTTP server, a TLS server with a self-signed certificate, and that certificate."""
    cert, key = _self_signed(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    plain, tls = _Counting(), _Counting(ctx)
    yield plain, tls, cert
    for s in (plain, tls):
        s.shutdown()
        s.server_close()


def _final_at_once(url: str) -> Unreachable:
    """What the client raises for ``url`` with minutes of retry budget, checked to come inside the hang
    guard (a retried failure would take the whole budget)."""
    t0 = time.monotonic()
    with CatalogClient(url, retry_seconds=BUDGET, token="") as c, pytest.raises(Unreachable) as e:
        c.list_runs()
    assert time.monotonic() - t0 < GUARD, "a failure that waiting cannot fix was retried"
    return e.value


def test_a_tls_mismatch_is_final_at_once_and_names_what_is_wrong(servers):
    plain, tls, cert = servers
    # https:// spoken to a plain-HTTP server: one connection, no retry.
    https_to_plain = plain.url.replace("http://", "https://")
    e = _final_at_once(https_to_plain)
    assert e.details["cause"] == "tls" and e.details["url"] == https_to_plain, e.details
    assert "TLS handshake failed" in e.message and "http://" in e.message, e.message
    assert plain.accepted == 1, plain.accepted
    # A certificate this machine does not trust: one connection, no retry.
    e = _final_at_once(tls.url)
    assert e.details["cause"] == "tls" and "certificate is not trusted" in e.message and "SSL_CERT_FILE" in e.message
    assert tls.accepted == 1, tls.accepted
    # Replicas: one whose TLS fails is passed over for the next; a refused one beside it does not loop.
    with CatalogClient([https_to_plain, plain.url], retry_seconds=BUDGET, token="") as c:
        assert c.list_runs() == []
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with CatalogClient([tls.url, refused], retry_seconds=BUDGET, token="", retry_refused=False) as c, \
                pytest.raises(Unavailable):
            c.list_runs()
    # The CLI: one line, exit 2.
    for url in (https_to_plain, tls.url):
        line = _one_line(_cli("ls", "--server", url), 2)
        assert f"cannot reach ckptd at {url}: " in line and "TLS" in line, line
    # What the message advises works: the certificate trusted through SSL_CERT_FILE.
    ok = _cli("ls", "--server", tls.url, env={"SSL_CERT_FILE": str(cert)})
    assert ok.returncode == 0 and "no runs in service" in ok.stderr, ok.stderr


def test_a_host_name_that_does_not_resolve_is_final_at_once():
    url = "http://ckptd-nowhere.invalid:8470"  # .invalid never resolves (RFC 2606)
    e = _final_at_once(url)
    assert e.details["cause"] == "dns" and "does not resolve" in e.message, e.message
    line = _one_line(_cli("ls", "--server", url), 2)
    assert line.startswith(f"ckptd: cannot reach ckptd at {url}: the host name does not resolve"), line


def test_a_refused_connection_is_still_retried_by_a_trainer(tmp_path):
    """A restarting service refuses for a moment: the client waits for it, within its budget."""
    srv = ServerProcess(tmp_path / "root")
    t = threading.Timer(scaled(1), srv.start)
    t.start()
    try:
        with CatalogClient(srv.url, retry_seconds=BUDGET, token="") as c:
            assert c.list_runs() == []
    finally:
        t.join()
        srv.stop()


# -- import onto a taken name --------------------------------------------------------------------------------
@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_an_import_onto_a_taken_name_is_refused_before_its_source_is_read(tmp_path):
    """The source's ``.metadata`` is a FIFO that no writer opens: an import that read it would block
    (until the hang guard). A taken name is refused first, offline and through a service; and a free
    name still reaches the source (the refusal names it), so the check is not a refusal of everything."""
    root = _root(tmp_path / "root")
    src = tmp_path / "dcp"
    src.mkdir()
    os.mkfifo(src / ".metadata")
    srv = ServerProcess(root).start()
    try:
        for target in (["--root", str(root)], ["--server", srv.url]):
            line = _one_line(_cli("import", "dcp", str(src), "cli/7", *target), 2)
            assert "checkpoint cli/7 is already committed" in line and "new name" in line, line
    finally:
        srv.stop()
    regular = tmp_path / "regular"
    regular.mkdir()
    (regular / ".metadata").write_bytes(b"not a pickle")
    line = _one_line(_cli("import", "dcp", str(regular), "cli/9", "--root", str(root)), 1)
    assert f"{regular / '.metadata'} is unreadable" in line, line


# -- a key of the other kind ------------------------------------------------------------------------------------
def test_a_key_of_the_other_kind_is_named_as_a_kind_mismatch(server):
    with CheckpointClient(server.url) as c:
        c.save({"model": {"w": torch.arange(4.0)}, "meta": {"epoch": 3}}, "kinds/1").wait()
        with pytest.raises(KindMismatch) as e:
            c.load({"model": {"w": 3}, "meta": {"epoch": 3}}, "kinds/1")
        assert e.value.message.startswith("key 'model.w' is stored as a tensor in checkpoint kinds/1, the state dict "
                                          "holds an object"), e.value.message
        assert e.value.details["key"] == "model.w" and isinstance(e.value, StateDictMismatch)
        with pytest.raises(KindMismatch) as e:
            c.load({"model": {"w": torch.zeros(4)}, "meta": {"epoch": torch.zeros(1)}}, "kinds/1", strict=False)
        assert "key 'meta.epoch' is stored as an object" in e.value.message and "holds a tensor" in e.value.message
        assert (e.value.details["stored"], e.value.details["asked"]) == ("object", "tensor"), e.value.details
