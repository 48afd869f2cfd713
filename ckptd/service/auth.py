"""Bearer-token authentication and per-route scopes.

Tokens come from a file (``CKPTD_TOKENS_FILE``, re-read when it changes) and/or inline
(``CKPTD_TOKENS``, where ``;`` also ends a line), one ``NAME TOKEN SCOPES [quota=SIZE]`` per line:
the format, the scopes (``read:PATTERN``, ``write:PATTERN``, ``admin``) and quotas are documented in
docs/security.md, Tokens; :func:`parse_tokens` is its one parser, and a malformed line stops start-up
naming the source and line, never the token. A presented token is hashed and compared with every
entry's hash using :func:`hmac.compare_digest`, without stopping at the first match.

Requests send ``Authorization: Bearer TOKEN``. Without a valid token the answer is 401
(``unauthorized``); with a token whose scopes do not cover the route and run, 403 (``forbidden``).
``/healthz``, ``/readyz``, ``/metrics`` and the API docs are open. Every route has an entry in
:data:`ROUTE_RULES`; :func:`check_routes` refuses an app with a route that has none. With no token
configured the service is open; ``ckptd serve`` allows that only on a loopback address unless told
otherwise (``--insecure-open``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

from fastapi import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd_schemas import Forbidden, PayloadTooLarge, Unauthorized

from ..store.space import parse_size
from .error_body import send_error
from .logs import route_name

__all__ = ["OPEN", "ROUTE_RULES", "AccessMiddleware", "AuthConfigError", "Principal", "Rule", "TokenStore",
           "authorize", "check_routes", "hash_token", "iter_routes", "match_route", "parse_tokens", "principal_for", "principal_named",
           "principal_of", "token_named"]

log = logging.getLogger("ckptd.service")

Access = Literal["open", "read", "write", "admin"]
BodyLimit = Literal["small", "index", "stream"]
SMALL_BODY_BYTES = 1 << 20  # JSON control bodies (open session, reshard request)
MIN_PLAIN_TOKEN = 16
MAX_TOKEN_CHARS = 4096
RELOAD_CHECK_SECONDS = 2.0
NO_TOKEN = ("this service requires a bearer token (header 'Authorization: Bearer TOKEN'; the client and the CLI "
            "send $CKPTD_TOKEN)")
_SCOPE_RE = re.compile(r"(read|write):([A-Za-z0-9._\-*?\[\]!]{1,256})|admin")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
_HASH_RE = re.compile(r"sha256:([0-9a-fA-F]{64})")


class AuthConfigError(ValueError):
    """The token configuration is unusable (the service refuses to start); never quotes a token."""


# -- principals and tokens -------------------------------------------------------------------------

@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a token's name, its scopes and its quota (bytes; None: none)."""

    name: str
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    admin: bool = False
    quota: int | None = None

    def can_read(self, run: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(run, p) for p in (*self.read, *self.write))

    def can_write(self, run: str) -> bool:
        return self.admin or any(fnmatch.fnmatchcase(run, p) for p in self.write)

    def allows(self, access: Access, run: str | None) -> bool:
        if access == "open":
            return True
        if access == "admin":
            return self.admin
        if run is None:
            return True  # listing routes: any token; the handler filters what it shows
        return self.can_read(run) if access == "read" else self.can_write(run)

    @property
    def scopes(self) -> str:
        parts = [f"read:{p}" for p in self.read] + [f"write:{p}" for p in self.write] + (["admin"] if self.admin else [])
        return ",".join(parts) or "none"


OPEN_PRINCIPAL = Principal("open", admin=True)  # no tokens configured: everything is allowed
ANONYMOUS = Principal("anonymous")  # tokens configured, none presented (open routes only): no scope at all


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token, as written after ``sha256:`` in a tokens file."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


def parse_tokens(text: str, source: str) -> list[_Entry]:
    """Parse the tokens format (docs/security.md, Tokens); errors name the source and line, never the token."""
    entries: list[_Entry] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    lines = text.replace(";", "\n").splitlines() if source == "CKPTD_TOKENS" else text.splitlines()
    for no, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {no}"
        fields = line.split()
        if len(fields) not in (3, 4):
            raise AuthConfigError(f"{where}: expected NAME TOKEN SCOPES [quota=SIZE] (3 or 4 fields separated by "
                                  f"blanks), found {len(fields)} fields")
        name, token, scopes = fields[:3]
        if not _NAME_RE.fullmatch(name):
            raise AuthConfigError(f"{where}: invalid token name (field 1, not shown): must match {_NAME_RE.pattern}")
        if name in names:
            raise AuthConfigError(f"{where}: token name {name!r} appears twice")
        m = _HASH_RE.fullmatch(token)
        if m:
            digest = bytes.fromhex(m[1])
        elif token.startswith("sha256:"):
            raise AuthConfigError(f"{where} ({name}): sha256: must be followed by 64 hex digits")
        elif len(token) < MIN_PLAIN_TOKEN:
            raise AuthConfigError(f"{where} ({name}): a plain token needs {MIN_PLAIN_TOKEN} characters at least "
                                  f"(or write sha256:HEX of the token)")
        else:
            digest = bytes.fromhex(hash_token(token))
        if digest in digests:
            raise AuthConfigError(f"{where} ({name}): the same token appears twice")
        read: list[str] = []
        write: list[str] = []
        admin = False
        for s in scopes.split(","):
            sm = _SCOPE_RE.fullmatch(s)
            if not sm:
                shown = repr(s[:80]) if s.startswith(("read:", "write:")) else "(not shown)"  # maybe a token
                raise AuthConfigError(f"{where} ({name}): invalid scope {shown}: expected read:PATTERN, "
                                      f"write:PATTERN or admin (fields: NAME TOKEN SCOPES)")
            if s == "admin":
                admin = True
            else:
                (read if sm[1] == "read" else write).append(sm[2])
        quota = _quota(fields[3], f"{where} ({name})") if len(fields) == 4 else None
        names.add(name)
        digests.add(digest)
        entries.append(_Entry(digest, Principal(name, tuple(read), tuple(write), admin, quota)))
    return entries


def _quota(item: str, where: str) -> int:
    """The bytes of a ``quota=SIZE`` field; anything else is refused (shown only when it says ``quota=``:
    a field out of place may be a token)."""
    key, eq, value = item.partition("=")
    if key != "quota" or not eq:
        raise AuthConfigError(f"{where}: the field after SCOPES (not shown) must be quota=SIZE")
    try:
        quota = parse_size(value)
    except ValueError as e:
        raise AuthConfigError(f"{where}: invalid quota: {e}") from None
    if quota <= 0:
        raise AuthConfigError(f"{where}: invalid quota {value[:40]!r}: more than 0 bytes (leave it out for no quota)")
    return quota


class TokenStore:
    """The configured tokens; the file is re-read when it changes (checked every 2 s at most).

    A changed file that no longer parses is logged and ignored: the previous tokens stay in force.
    """

    def __init__(self, file: str | None = None, inline: str | None = None) -> None:
        self.file = file or None
        self._inline = parse_tokens(inline, "CKPTD_TOKENS") if inline else []
        self._from_file: list[_Entry] = []
        self._mtime: float | None = None
        self._checked = 0.0
        if self.file:
            self._load_file(initial=True)

    @classmethod
    def from_settings(cls, settings: Any) -> "TokenStore":
        inline = settings.tokens.get_secret_value() if settings.tokens is not None else None
        return cls(settings.tokens_file, inline)

    def _load_file(self, *, initial: bool = False) -> None:
        assert self.file
        try:
            st = os.stat(self.file)
            with open(self.file, encoding="utf-8") as f:
                entries = parse_tokens(f.read(), self.file)
        except (OSError, UnicodeDecodeError, AuthConfigError) as e:
            if initial:
                if isinstance(e, AuthConfigError):
                    raise
                raise AuthConfigError(f"cannot read tokens file {self.file}: {type(e).__name__}: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
            log.error("tokens file %s changed but is unusable, keeping the previous tokens: %s", self.file,
                      e if isinstance(e, AuthConfigError) else type(e).__name__)
            self._mtime = None
            return
        if not initial:
            log.warning("tokens file %s reloaded: %d tokens", self.file, len(entries))
        self._from_file, self._mtime = entries, st.st_mtime

    def _maybe_reload(self) -> None:
        if not self.file:
            return
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        try:
            mtime = os.stat(self.file).st_mtime
        except OSError:
            return
        if mtime != self._mtime:
            self._load_file()

    @property
    def entries(self) -> list[_Entry]:
        return [*self._from_file, *self._inline]

    @property
    def enabled(self) -> bool:
        """True when any token is configured (a tokens file that is set counts, even if empty)."""
        return bool(self.file) or bool(self._inline)

    def named(self, name: str) -> _Entry | None:
        """The entry of the token called ``name`` now (the file re-read when it changed)."""
        self._maybe_reload()
        return next((e for e in self.entries if e.principal.name == name), None)

    def authenticate(self, token: str) -> Principal | None:
        self._maybe_reload()
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: Principal | None = None
        for e in self.entries:  # no early exit: the time taken does not depend on which entry matches
            if hmac.compare_digest(e.digest, digest):
                found = e.principal
        return found


# -- what each route needs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    access: Access
    body: BodyLimit = "small"
    run_param: str | None = "run"  # the path parameter naming the run the access applies to


OPEN = Rule("open", run_param=None)
ROUTE_RULES: dict[str, Rule] = {
    # probes, metrics and the API description: open
    "index": OPEN, "healthz": OPEN, "readyz": OPEN, "metrics": OPEN,
    "openapi": OPEN, "swagger_ui_html": OPEN, "swagger_ui_redirect": OPEN, "docs_asset": OPEN,
    # reads: read:RUN (write:RUN and admin include it)
    "list_runs": Rule("read", run_param=None),  # any token; only the runs it may read are listed
    "list_checkpoints": Rule("read"),
    "get_manifest": Rule("read"),
    "read_plan": Rule("read", body="index"),
    "get_load_tree": Rule("read"),
    "load_tree_pieces": Rule("read", body="index"),
    "get_file": Rule("read"),
    "verify_checkpoint": Rule("read"),  # runs in a worker; the record it writes is derived, never the data
    "report_damage": Rule("read"),  # the same: a failure is recorded only when the service's own check finds it
    "get_verification": Rule("read"),
    "hold_lease": Rule("read"),  # a lease only keeps a checkpoint; it changes nothing else
    "release_lease": Rule("read"),
    # the web view (ui_routes, ui_static): its JSON is read:RUN like the reads above (/v1/ui/runs lists only the
    # runs the token may read); its shell and assets are static files with no data, open
    "ui_runs": Rule("read", run_param=None), "ui_checkpoints": Rule("read"), "ui_steps": Rule("read"),
    "ui_checkpoint": Rule("read"), "ui_tensors": Rule("read"), "ui_objects": Rule("read"),
    "ui_uploads": Rule("read"), "ui_jobs": Rule("read"), "ui_job_plan": Rule("read"), "ui_retention": Rule("read"),
    "ui_shell": OPEN, "ui_asset": OPEN,
    # uploads: write:RUN
    "open_session": Rule("write"),
    "upload_file": Rule("write", body="stream"),
    "link_file": Rule("write"),
    "presign_file": Rule("write"),  # a URL that writes one object of the session, with a signed size and SHA-256
    "confirm_file": Rule("write"),
    "put_index": Rule("write", body="index"),
    "session_status": Rule("write"),
    "abort_session": Rule("write"),
    "keep_session_alive": Rule("write"),
    # one checkpoint's removal, under retention's protections (a trainer's own "keep the best k")
    "remove_checkpoint": Rule("write"),
    # reshard jobs (and future gc / import routes): admin
    "create_job": Rule("admin", run_param=None),
    "preview_job": Rule("admin", run_param=None),
    "job_status": Rule("admin", run_param=None),
    # conversion drills (drill_routes): jobs are admin, as reshard jobs; the record is read:RUN, as a verification
    "create_drill": Rule("admin", run_param=None),
    "drill_status": Rule("admin", run_param=None),
    "get_drill": Rule("read"),
    "run_gc": Rule("admin"),
}


def iter_routes(routes: Any) -> Iterator[Any]:
    """Every leaf route (with ``path``, ``name``, ``methods``), routers included by FastAPI walked into."""
    for r in getattr(routes, "routes", routes):
        inner = getattr(getattr(r, "original_router", None), "routes", None)
        if inner is not None:  # FastAPI >= 0.16x keeps included routers as nodes
            yield from iter_routes(inner)
        elif hasattr(r, "path") and hasattr(r, "name"):
            yield r


def match_route(scope: Scope, routes: Sequence[Any]) -> None:
    """Put the route a request refused before routing was for in its scope, as the router would have:
    the access log and the metrics then name it instead of ``unmatched``."""
    for route in iter_routes(routes):
        if route.matches(scope)[0] == Match.FULL:
            scope["route"] = route
            return


def check_routes(app: Any) -> None:
    missing = sorted({f"{r.name} ({r.path})" for r in iter_routes(app.router) if r.name not in ROUTE_RULES})
    if missing:
        raise RuntimeError(f"routes without an access rule in ckptd.service.auth.ROUTE_RULES: {missing}")


def principal_for(tokens: TokenStore, token: str | None) -> Principal:
    """Who a bearer token acts as: every way in asks this (the HTTP middleware, co-located uploads).
    Everything is allowed when no tokens are configured; :class:`Unauthorized` for a missing or
    unknown token."""
    if not tokens.enabled:
        return OPEN_PRINCIPAL
    principal = tokens.authenticate(token) if token and len(token) <= MAX_TOKEN_CHARS else None
    if principal is None:
        raise Unauthorized(NO_TOKEN if token is None else "the bearer token is not valid")
    return principal


def principal_named(tokens: TokenStore, name: str) -> Principal:
    """The principal called ``name`` now (the tokens file re-read when it changed), for a way in whose
    proof names its principal rather than presenting its token (co-located uploads: a key the service
    gave that principal over HTTP); :class:`Unauthorized` when no token has that name any more."""
    if not tokens.enabled:
        return OPEN_PRINCIPAL
    if (entry := tokens.named(name)) is None:
        raise Unauthorized(f"no token is named {name[:64]!r} any more")
    return entry.principal


def token_named(tokens: TokenStore, name: str) -> bytes:
    """The SHA-256 of the token called ``name`` now (empty where there is none, or authentication is
    off): what a key given to that principal is bound to as well, so that a token replaced under the
    same name (rotated after a leak) takes every key given to its holder with it."""
    entry = tokens.named(name) if tokens.enabled else None
    return entry.digest if entry is not None else b""


def principal_of(request: Request) -> Principal:
    p = request.scope.get("state", {}).get("principal")
    return p if isinstance(p, Principal) else ANONYMOUS


async def authorize(request: Request) -> None:
    """App-wide dependency: the matched route's rule against the request's principal (403)."""
    name = route_name(request.scope)
    rule = ROUTE_RULES.get(name)
    principal = principal_of(request)
    if rule is None:
        raise Forbidden(f"route {name!r} has no access rule", route=name)
    if rule.access != "open" and principal is ANONYMOUS:  # e.g. another method on an open route's path
        raise Unauthorized(NO_TOKEN)
    run = request.path_params.get(rule.run_param) if rule.run_param else None
    if principal.allows(rule.access, run if isinstance(run, str) else None):
        return
    if rule.access == "admin":
        raise Forbidden(f"token {principal.name!r} (scopes {principal.scopes}) lacks the admin scope that "
                        f"{request.method} {request.url.path[:200]} needs", token=principal.name, needs="admin")
    raise Forbidden(f"token {principal.name!r} (scopes {principal.scopes}) may not {rule.access} run {run!r}",
                    token=principal.name, needs=f"{rule.access}:{run}")


# -- the middleware: authentication and body limits ----------------------------------------------------

def _bearer(scope: Scope) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            try:
                value = v.decode("latin-1").strip()
            except UnicodeDecodeError:
                return ""
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer":
                return ""
            return token.strip()
    return None


class AccessMiddleware:
    """401 before anything is routed or read; body limits by route once routed.

    Authentication runs first, for every path that is not an open route, so a
    request without a valid token never reaches a handler (or has its body
    read). Which run a route touches is only known once FastAPI has routed the
    request; :func:`authorize` (an app-wide dependency) checks that (403).
    The body limit of the matched route (``Rule.body``) applies to the first
    body read: a declared Content-Length over it is answered 413 at once, and
    a body that grows past it is cut off with 413.
    """

    def __init__(self, app: ASGIApp, tokens: TokenStore, open_paths: set[str], index_limit: int,
                 routes: Sequence[Any] = ()) -> None:
        self.app, self.tokens, self.open_paths, self.index_limit = app, tokens, open_paths, index_limit
        self.routes = routes

    def _limit(self, scope: Scope) -> int | None:
        rule = ROUTE_RULES.get(route_name(scope))
        body = rule.body if rule is not None else "index"
        return None if body == "stream" else self.index_limit if body == "index" else SMALL_BODY_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if not self.tokens.enabled:
            state["principal"] = OPEN_PRINCIPAL
        elif scope["path"] in self.open_paths:
            state["principal"] = ANONYMOUS
        else:
            try:
                state["principal"] = principal_for(self.tokens, _bearer(scope))
            except Unauthorized as e:
                match_route(scope, self.routes)
                await send_error(send, scope, e, [(b"www-authenticate", b'Bearer realm="ckptd"')])
                return

        responded = False
        checked = False
        seen = 0

        async def limited_receive() -> Message:
            nonlocal checked, seen
            if responded:
                return {"type": "http.disconnect"}
            limit = self._limit(scope)  # the router has matched by now: the route is in the scope
            if not checked:
                checked = True
                declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
                if limit is not None and declared is not None and declared.isdigit() and int(declared) > limit:
                    await reject(f"body of {int(declared)} bytes exceeds the limit of {limit} for this route", limit)
                    return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request" and limit is not None:
                seen += len(msg.get("body", b""))
                if seen > limit:
                    await reject(f"body exceeds the limit of {limit} bytes for this route", limit)
                    return {"type": "http.disconnect"}
            return msg

        async def reject(message: str, limit: int) -> None:
            nonlocal responded
            responded = True
            state["ckptd_answered"] = True  # the disconnect the handler meets next is this answer's (limits)
            await send_error(send, scope, PayloadTooLarge(message, limit=limit), [(b"connection", b"close")])

        async def guarded_send(msg: Message) -> None:
            if not responded:  # after a 413 the handler's own answer (to the disconnect) is dropped
                await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not responded:
                raise
            # Answered 413 already; the handler then met the disconnect it was given (ClientDisconnect).
