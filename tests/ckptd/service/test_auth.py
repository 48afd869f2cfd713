"""Authentication: bearer tokens, scopes on every route, open mode, limits, tokens kept out of logs.

* every route of the app (walked from its route table, so a new route cannot be
  forgotten) answers 401 without a token, 403 with a token out of its scope, and
  gets past authorization with the right one;
* the tokens format (hashed and plain tokens, errors that never quote a token),
  and the scope rules (write includes read, admin everything, listing filtered);
* a real ``ckptd serve`` with a tokens file: a client saves and loads with its
  token, a missing or out-of-scope token fails at once (no retries) with the
  typed error, and the debug-level log never holds the token;
* open mode: refused on a non-loopback address, announced on loopback;
* oversized bodies, names and headers are refused with 4xx, never 5xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
import xxhash
from pydantic import SecretStr

from ckptd.service import Settings, create_app
from ckptd.service.auth import (
    ROUTE_RULES, AuthConfigError, Principal, TokenStore, check_routes, hash_token, iter_routes, parse_tokens,
)
from ckptd.service.server import check_open_mode, is_loopback
from ckptd.storage import LocalStorage
from ckptd_client import CheckpointClient
from ckptd_schemas import Forbidden, Unauthorized, error_from_body
from support import REPO, ServerProcess, assert_bits_equal, blank_like, free_port, make_state, scaled

ADMIN, WRITER, READER, OTHER = ("admin-token-0123456789", "writer-token-0123456789", "reader-token-0123456789",
                                "other-token-0123456789")
TOKENS = (f"ops {ADMIN} admin\n"
          f"trainer sha256:{hash_token(WRITER)} write:gpt*\n"
          f"# a comment line, then a token with a trailing comment\n"
          f"dash sha256:{hash_token(READER)} read:gpt,read:demo   # dashboards\n"
          f"other {OTHER} read:zzz*,write:zzz*\n")
SAMPLES = {"run": "gpt", "name": "1", "sid": "s1", "file": "f.bin", "rank": "0", "job_id": "abc123"}


def _call(app, method: str, url: str, token: str | None = None, **kw) -> httpx.Response:
    headers = dict(kw.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, headers=headers, **kw)
    return asyncio.run(go())


@pytest.fixture
def app(tmp_path):
    return create_app(Settings(root=str(tmp_path), tokens=SecretStr(TOKENS)), LocalStorage(tmp_path))


def _operations(app) -> list[tuple[str, str, str]]:
    """(route name, method, concrete URL) for every route and method of the app."""
    ops = []
    for r in iter_routes(app.router):
        for method in sorted(getattr(r, "methods", None) or {"GET"}):
            if method == "HEAD":
                continue
            url = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: SAMPLES.get(m[1], "x1"), r.path)
            ops.append((r.name, method, url))
    return ops


def _body_for(name: str) -> dict:
    if name in ("create_job", "preview_job"):
        return {"json": {"source": "gpt/1", "to": "full"}}
    if name == "create_drill":
        return {"json": {"source": "gpt/1", "to": ["full"]}}
    if name == "run_gc":
        return {"json": {"keep_last": 1, "dry_run": True}}
    if name == "open_session":
        return {"json": {"session": "s1", "world_size": 1}}
    if name == "read_plan":
        return {"json": {"requests": []}}
    if name == "upload_file":
        return {"content": b"abc", "headers": {"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(b"abc")}}
    if name == "put_index":
        return {"json": {"rank": 0, "world_size": 1}}
    return {}


# -- the route table -----------------------------------------------------------------------------------

def test_every_route_has_a_rule_and_the_expected_scope(app):
    check_routes(app)  # create_app calls it too: an app with a route missing from ROUTE_RULES is refused
    ops = _operations(app)
    names = {n for n, _, _ in ops}
    assert names <= set(ROUTE_RULES), names - set(ROUTE_RULES)
    # The route table and the OpenAPI description agree: nothing served is left out of the walk.
    doc = _call(app, "GET", "/openapi.json").json()
    api_ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    walked = {(m, r.path) for r in iter_routes(app.router) for m in (r.methods or ()) if m != "HEAD"}
    assert api_ops <= walked, api_ops - walked
    for r in iter_routes(app.router):
        rule = ROUTE_RULES[r.name]
        if r.path.startswith(("/v1/reshard", "/v1/jobs", "/v1/drill")) or r.path.endswith("/gc"):
            assert rule.access == "admin", r.path
        elif "/sessions" in r.path or (r.path == "/v1/checkpoints/{run}/{name}" and r.methods == {"DELETE"}):
            assert rule.access == "write", r.path  # uploads, and a trainer's removal of one checkpoint
        elif r.path.startswith("/v1/"):
            assert rule.access == "read", r.path
        else:
            assert rule.access == "open" and "{" not in r.path, r.path


def test_a_route_without_a_rule_is_refused(tmp_path):
    app = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))

    @app.get("/v1/unruled")
    async def unruled() -> dict:
        return {}

    with pytest.raises(RuntimeError, match="unruled"):
        check_routes(app)


def test_every_route_refuses_without_a_token_and_out_of_scope(app):
    checked = 0
    for name, method, url in _operations(app):
        rule = ROUTE_RULES[name]
        kw = _body_for(name)
        anon = _call(app, method, url, **kw)
        if rule.access == "open":
            assert anon.status_code not in (401, 403), (name, anon.text)
            continue
        assert anon.status_code == 401, (name, method, url, anon.status_code, anon.text)
        body = anon.json()["error"]
        assert body["code"] == "unauthorized" and body["request_id"] == anon.headers["x-request-id"]
        assert anon.headers["www-authenticate"].startswith("Bearer")
        assert isinstance(error_from_body(anon.json(), 401), Unauthorized)
        assert _call(app, method, url, token="not-a-known-token-at-all", **kw).status_code == 401, name
        # Out of scope: another run's token, a reader on a write route, a writer on an admin route.
        wrong = {"read": OTHER, "write": READER, "admin": WRITER}[rule.access]
        if rule.run_param is not None or rule.access == "admin":
            denied = _call(app, method, url, token=wrong, **kw)
            assert denied.status_code == 403, (name, method, url, denied.status_code, denied.text)
            assert denied.json()["error"]["code"] == "forbidden"
            assert isinstance(error_from_body(denied.json(), 403), Forbidden)
        # The right scope gets past authentication and authorization (the answer itself may be 404 or 4xx).
        right = {"read": READER, "write": WRITER, "admin": ADMIN}[rule.access]
        for token in (right, ADMIN):
            ok = _call(app, method, url, token=token, **kw)
            # (a read lease another token holds is refused by the lease's owner rule, naming the holder)
            owned = ok.status_code == 403 and "holder" in ok.json()["error"]["details"]
            assert ok.status_code not in (401, 403) or owned, (name, method, url, ok.status_code, ok.text)
        checked += 1
    assert checked == sum(r.access != "open" for r in ROUTE_RULES.values())


def test_unknown_paths_need_a_token_too(app):
    assert _call(app, "GET", "/v1/nothing-here").status_code == 401
    assert _call(app, "GET", "/v1/nothing-here", token=READER).status_code == 404
    assert _call(app, "PATCH", "/v1/runs", token=READER).status_code == 405
    assert _call(app, "GET", "/v1/runs", headers={"Authorization": f"Basic {ADMIN}"}).status_code == 401
    assert _call(app, "GET", "/v1/runs", token="x" * 5000).status_code == 401
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert _call(app, "GET", path).status_code == 200, path


def test_a_guarded_route_on_an_open_path_still_needs_a_token(app):
    """Open paths skip authentication; a non-open route sharing such a path is refused by authorize."""
    @app.post("/healthz", name="list_runs")  # borrows a rule that needs a token
    async def sneaky() -> dict:
        return {"leaked": True}

    r = _call(app, "POST", "/healthz")
    assert r.status_code == 401 and "leaked" not in r.text
    assert _call(app, "POST", "/healthz", token=READER).status_code == 401  # open paths take no token at all
    assert _call(app, "GET", "/healthz").status_code == 200


def _commit(app, run: str, token: str) -> None:
    data = b"\x00" * 16
    digest = xxhash.xxh3_64_hexdigest(data)
    base = f"/v1/checkpoints/{run}/1/sessions"
    assert _call(app, "POST", base, token, json={"session": "s1", "world_size": 1, "step": 1}).status_code == 200
    r = _call(app, "PUT", f"{base}/s1/files/f.bin", token, content=data, headers={"X-Ckptd-Xxh3": digest})
    assert r.status_code == 200, r.text
    index = {"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [{
        "name": "t", "shape": [4], "dtype": "float32", "group": "t", "chunks": [{
            "kind": "box", "rank": 0, "offsets": [0], "sizes": [4],
            "location": {"file": "f.bin", "offset": 0, "length": 16, "raw_length": 16, "xxh3": digest}}]}]}
    r = _call(app, "PUT", f"{base}/s1/ranks/0", token, json=index)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def test_scopes_write_includes_read_and_listing_is_filtered(app):
    _commit(app, "gpt", WRITER)
    _commit(app, "demo", ADMIN)
    _commit(app, "secret", ADMIN)
    runs = lambda tok: sorted(r["run"] for r in _call(app, "GET", "/v1/runs", tok).json())  # noqa: E731
    assert runs(ADMIN) == ["demo", "gpt", "secret"]
    assert runs(READER) == ["demo", "gpt"]
    assert runs(WRITER) == ["gpt"]
    assert runs(OTHER) == []
    assert _call(app, "GET", "/v1/checkpoints/gpt/latest", WRITER).status_code == 200  # write includes read
    assert _call(app, "GET", "/v1/checkpoints/secret/1", READER).status_code == 403
    assert _call(app, "GET", "/v1/runs/secret/checkpoints", READER).status_code == 403
    assert _call(app, "GET", "/v1/checkpoints/demo/1/files/f.bin", READER).status_code == 200
    r = _call(app, "POST", "/v1/checkpoints/gpt/2/sessions", READER, json={"session": "s2", "world_size": 1})
    assert r.status_code == 403 and "'dash'" in r.json()["error"]["message"]
    # The pattern is fnmatch on the whole run name: write:gpt* covers gpt-small, read:gpt not gpt2.
    assert _call(app, "POST", "/v1/checkpoints/gpt-small/1/sessions", WRITER,
                 json={"session": "s1", "world_size": 1}).status_code == 200
    assert _call(app, "GET", "/v1/runs/gpt2/checkpoints", READER).status_code == 403


def test_principal_rules():
    p = Principal("p", read=("a*",), write=("b",))
    assert p.can_read("a1") and p.can_read("b") and not p.can_read("c")
    assert p.can_write("b") and not p.can_write("a1")
    assert not p.allows("admin", None) and p.allows("read", None) and p.allows("open", "x")
    assert Principal("root", admin=True).allows("write", "anything")


# -- the tokens format -----------------------------------------------------------------------------------

def test_tokens_format_hashed_plain_and_comments():
    entries = parse_tokens(TOKENS, "t")
    assert [e.principal.name for e in entries] == ["ops", "trainer", "dash", "other"]
    assert entries[2].principal.read == ("gpt", "demo")
    store = TokenStore(inline=TOKENS)
    assert store.authenticate(WRITER).name == "trainer"
    assert store.authenticate(ADMIN).admin
    assert store.authenticate(hash_token(WRITER)) is None  # the hash is not a token
    assert store.authenticate("nope") is None
    assert hash_token(WRITER) == hashlib.sha256(WRITER.encode()).hexdigest()
    assert TokenStore(inline=f"a {ADMIN} admin; b {WRITER} write:*").authenticate(WRITER).name == "b"


def test_a_quota_is_an_optional_fourth_field_and_lines_without_it_have_none():
    entries = parse_tokens(f"a {ADMIN} write:gpt* quota=500GiB\nb {WRITER} admin   # quota=1GiB is a comment\n"
                           f"c sha256:{hash_token('c' * 20)} read:x quota=1.5TB\nd {'d' * 16} write:d quota=4096", "t")
    assert [(e.principal.name, e.principal.quota) for e in entries] == [
        ("a", 500 << 30), ("b", None), ("c", 1_500_000_000_000), ("d", 4096)]
    assert entries[0].principal.write == ("gpt*",) and entries[0].principal.scopes == "write:gpt*"
    store = TokenStore(inline=f"a {ADMIN} write:gpt* quota=2MiB; b {WRITER} write:*")
    assert store.authenticate(ADMIN).quota == 2 << 20 and store.authenticate(WRITER).quota is None


@pytest.mark.parametrize("text, match", [
    ("ops admin", "3 or 4 fields"),
    (f"ops {ADMIN} admin quota=1GiB extra", "3 or 4 fields"),
    (f"ops {ADMIN} admin quota=lots", "invalid quota: 'lots' is not a size"),
    (f"ops {ADMIN} admin quota=0", "more than 0 bytes"),
    (f"ops {ADMIN} admin quota=-5GiB", "invalid quota"),
    (f"ops {ADMIN} admin quota=5XB", "invalid quota"),
    (f"ops {ADMIN} admin {WRITER}", "must be quota=SIZE"),  # a token out of place: not quoted
    (f"ops {ADMIN} admin size=5GiB", "must be quota=SIZE"),
    (f"ops {ADMIN} admin,root", "invalid scope"),
    (f"ops {ADMIN} {WRITER}", "invalid scope"),         # fields in the wrong order: not quoted
    (f"{ADMIN}/x ops admin", "invalid token name"),
    ("ops short admin", "16 characters"),
    ("ops sha256:abcd admin", "64 hex"),
    (f"a {ADMIN} admin\nb {ADMIN} admin", "twice"),
    (f"a {ADMIN} admin\na {WRITER} admin", "twice"),
])
def test_tokens_format_errors_name_the_line_never_the_token(text, match):
    with pytest.raises(AuthConfigError, match=match) as e:
        parse_tokens(text, "tokens.txt")
    assert "tokens.txt line" in str(e.value)
    for secret in (ADMIN, WRITER):
        assert secret not in str(e.value)


def test_tokens_file_is_reloaded_when_it_changes(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"ops {ADMIN} admin\n")
    store = TokenStore(file=str(f))
    assert store.authenticate(ADMIN) and store.authenticate(WRITER) is None
    f.write_text(f"trainer {WRITER} write:gpt\n")
    os.utime(f, (time.time() + 5, time.time() + 5))
    store._checked = 0.0  # the 2 s between checks has passed
    assert store.authenticate(WRITER).name == "trainer" and store.authenticate(ADMIN) is None
    f.write_text("broken line\n")  # an unusable change keeps the previous tokens
    os.utime(f, (time.time() + 10, time.time() + 10))
    store._checked = 0.0
    assert store.authenticate(WRITER).name == "trainer"
    with pytest.raises(AuthConfigError, match="cannot read tokens file"):
        TokenStore(file=str(tmp_path / "missing"))


# -- open mode -------------------------------------------------------------------------------------------

def test_open_mode_only_on_loopback(tmp_path, caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("ckptd.example")
    none = TokenStore()
    with pytest.raises(AuthConfigError, match="refusing to serve on 0.0.0.0 without authentication"):
        check_open_mode(Settings(root=str(tmp_path), host="0.0.0.0"), none)
    with caplog.at_level("WARNING", logger="ckptd.service"):
        check_open_mode(Settings(root=str(tmp_path), host="0.0.0.0", insecure_open=True), none)
        check_open_mode(Settings(root=str(tmp_path), host="127.0.0.1"), none)
    assert sum("authentication is off" in r.getMessage() for r in caplog.records) == 2
    check_open_mode(Settings(root=str(tmp_path), host="0.0.0.0"), TokenStore(inline=TOKENS))  # tokens: fine
    # Open mode on loopback: everything is allowed.
    app = create_app(Settings(root=str(tmp_path)), LocalStorage(tmp_path))
    assert _call(app, "GET", "/v1/runs").status_code == 200


def _serve_cmd(tmp_path, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "serve", "--root", str(tmp_path / "root"),
                           "--port", str(free_port()), *args], env=full, capture_output=True, text=True,
                          timeout=timeout)


def test_serve_refuses_open_mode_on_a_non_loopback_host(tmp_path):
    r = _serve_cmd(tmp_path, "--host", "0.0.0.0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to serve on 0.0.0.0 without authentication" in r.stderr and "--insecure-open" in r.stderr
    # A broken tokens file stops it too, naming the line and not the token.
    bad = tmp_path / "tokens"
    bad.write_text(f"ops {ADMIN}\n")
    r = _serve_cmd(tmp_path, "--host", "0.0.0.0", "--tokens-file", str(bad))
    assert r.returncode == 2 and f"{bad} line 1" in r.stderr and ADMIN not in r.stderr + r.stdout
    bad.write_text(f"ops {ADMIN} admin quota=1GiB\ntrainer {WRITER} write:gpt quota=many\n")  # a malformed quota
    r = _serve_cmd(tmp_path, "--tokens-file", str(bad))
    assert r.returncode == 2 and f"{bad} line 2 (trainer): invalid quota" in r.stderr, r.stderr
    assert ADMIN not in r.stderr + r.stdout and WRITER not in r.stderr + r.stdout


# -- a real service ----------------------------------------------------------------------------------------

@pytest.fixture
def authed(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS_FILE": str(tokens)},
                        args=["--log-level", "debug", "--log-format", "json"])
    srv.start()
    yield srv
    srv.stop()


def test_client_saves_and_loads_with_a_token_and_the_token_is_never_logged(authed, monkeypatch):
    sd = make_state(3)
    with CheckpointClient(authed.url, token=WRITER, retry_seconds=30) as c:
        c.save(sd, "gpt/10").wait()
        got = blank_like(sd)
        c.load(got, "gpt/10")
    assert_bits_equal(got, sd)
    monkeypatch.setenv("CKPTD_TOKEN", READER)  # the default token comes from the environment
    with CheckpointClient(authed.url, retry_seconds=30) as c:
        assert [r.run for r in c.list_runs()] == ["gpt"]
        got = blank_like(sd)
        c.load(got, "gpt/latest")
        assert_bits_equal(got, sd)
    c = CheckpointClient(authed.url, retry_seconds=30)
    with pytest.raises(Forbidden, match="may not write run 'gpt'"):
        c.save(sd, "gpt/11").wait()
    c.close(wait=False)
    monkeypatch.delenv("CKPTD_TOKEN")
    # Refusals are not retried: they fail at once even with a long retry budget.
    with CheckpointClient(authed.url, retry_seconds=60) as c:
        t0 = time.monotonic()
        with pytest.raises(Unauthorized, match="bearer token") as e:
            c.list_runs()
        assert time.monotonic() - t0 < scaled(10) and e.value.request_id  # far from the 60 s a retry would take
    with CheckpointClient(authed.url, token=OTHER, retry_seconds=60) as c:
        t0 = time.monotonic()
        with pytest.raises(Forbidden):
            c.manifest("gpt/10")
        assert time.monotonic() - t0 < scaled(10)
    # The CLI's --server paths take the token from the environment.
    env = {**os.environ, "CKPTD_TOKEN": READER}
    r = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "ls", "gpt", "--server", authed.url], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "gpt/10" in r.stdout, r.stdout + r.stderr
    env.pop("CKPTD_TOKEN")
    r = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "gpt/10", "--server", authed.url], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bearer token" in r.stderr, r.stdout + r.stderr
    # Raw requests with tokens in every header the service might echo.
    httpx.get(f"{authed.url}/v1/runs", headers={"Authorization": f"Bearer {ADMIN}"})
    httpx.get(f"{authed.url}/v1/runs", headers={"Authorization": f"bearer {OTHER}x"})
    authed.stop()
    text = authed.log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    # the files were handed over on this host (co-located uploads), each logged with its token's name
    assert any(x.get("route") == "local_upload" and x.get("principal") == "trainer" and x.get("status") == 200
               for x in lines)
    assert any(x.get("status") == 401 and x.get("level") == "warning" for x in lines)
    for secret in (ADMIN, WRITER, READER, OTHER, hash_token(WRITER)):
        assert secret not in text, "a token appears in the server's log"


def _chunked(pieces: list[bytes]):
    """A streamed body of unknown length (chunked transfer encoding)."""
    async def gen():
        for p in pieces:
            yield p
    return gen()


def _raw(port: int, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` on one connection; the first bytes of the answer (b"" when it was cut off)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            for p in pieces:
                s.sendall(p)
        except OSError:
            pass  # the server closed the connection: refused
        try:
            return s.recv(200)
        except OSError:
            return b""


def test_oversized_names_headers_and_bodies_are_4xx(authed, app):
    auth = {"Authorization": f"Bearer {ADMIN}"}
    # Names: checked by the store's grammar (400), however long.
    r = httpx.get(f"{authed.url}/v1/checkpoints/{'a' * 5000}/1", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name"
    r = httpx.get(f"{authed.url}/v1/jobs/{'a' * 5000}", headers=auth)
    assert r.status_code == 404
    # Request line and headers: bounded by the server (431), whether or not a token comes with them.
    for headers in ({"X-Big": "a" * (100 << 10)}, {**auth, "X-Big": "a" * (100 << 10)}):
        r = httpx.get(f"{authed.url}/v1/runs", headers=headers)
        assert r.status_code == 431 and r.json()["error"]["code"] == "payload_too_large"
    long_url = b"GET /v1/runs/" + b"a" * (100 << 10) + b"/checkpoints HTTP/1.1\r\nHost: x\r\n\r\n"
    assert _raw(authed.port, [long_url]).startswith(b"HTTP/1.1 431")
    endless = [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "] + [b"a" * (16 << 10)] * 64  # one endless header
    got = _raw(authed.port, endless)
    assert not got or got.startswith(b"HTTP/1.1 431")
    assert httpx.get(f"{authed.url}/healthz").status_code == 200  # and it still serves
    # JSON control bodies: 1 MiB, declared or streamed (chunked).
    big = json.dumps({"session": "s1", "world_size": 1, "pad": "x" * (2 << 20)}).encode()
    r = httpx.post(f"{authed.url}/v1/checkpoints/gpt/1/sessions", headers=auth, content=big)
    assert r.status_code == 413
    r = _call(app, "POST", "/v1/checkpoints/gpt/1/sessions", ADMIN, content=_chunked([big[:1 << 19]] * 4))
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    r = _call(app, "POST", "/v1/reshard/preview", ADMIN, content=_chunked([b" " * (1 << 19)] * 4))
    assert r.status_code == 413
    # Index bodies: CKPTD_MAX_INDEX_BYTES; data files: streamed, no limit here.
    small = create_app(Settings(root=str(authed.root), max_index_bytes=1000, tokens=SecretStr(TOKENS)),
                       LocalStorage(authed.root))
    r = _call(small, "PUT", "/v1/checkpoints/gpt/1/sessions/s1/ranks/0", ADMIN, content=_chunked([b" " * 600] * 2))
    assert r.status_code == 413
    data = b"z" * 5000
    assert _call(small, "POST", "/v1/checkpoints/gpt/1/sessions", ADMIN,
                 json={"session": "s1", "world_size": 1}).status_code == 200
    r = _call(small, "PUT", "/v1/checkpoints/gpt/1/sessions/s1/files/f.bin", ADMIN, content=_chunked([data]),
              headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200 and r.json()["size"] == 5000


def test_deploy_tokens_secret_template_refuses_to_start(tmp_path):
    """The k8s Secret template's placeholder is not a valid tokens file: the service says so and stops."""
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy/k8s/secret.yaml").read_text()))
    placeholder = next(d for d in docs if d and d["metadata"]["name"] == "ckptd-tokens")["stringData"]["tokens"]
    f = tmp_path / "tokens"
    f.write_text(placeholder)
    with pytest.raises(AuthConfigError, match="line 1"):
        TokenStore(file=str(f))


def test_a_refused_request_is_counted_under_its_route(app):
    """401s are answered before routing; the metrics and the access log still name the route."""
    assert _call(app, "GET", "/v1/runs").status_code == 401
    assert _call(app, "GET", "/v1/checkpoints/gpt/1").status_code == 401
    assert _call(app, "GET", "/v1/nothing-here").status_code == 401
    text = _call(app, "GET", "/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("ckptd_http_requests_total{") and 'status="401"' in ln]
    routes = {re.search(r'route="([^"]*)"', ln)[1] for ln in lines}
    assert {"list_runs", "get_manifest", "unmatched"} <= routes, lines
