"""Per-request limits (:mod:`ckptd.service.limits`) as units, without a server.

The two ASGI middlewares are driven directly on one event loop, wrapped around a small app that does
what a route does (reads the body, answers), so each case is exact: which request is refused, with
which status, error code, details and headers, and what the app behind sees. What a real socket adds
(a client that trickles bytes, the service's metrics) is in tests/ckptd/service/test_refusals.py and
tests/adversary/test_request_deadlines.py.

* :class:`UploadSlots`: at most ``limit`` uploads per token, ``TooManyRequests`` naming token, file
  and limit; a release gives back one slot, once; 0 means no limit.
* :class:`PrincipalRequests`: a token's requests over the limit are answered 429 (``Retry-After``,
  ``Connection: close`` when a body would follow) and never reach the app; other tokens, open paths
  and anonymous requests are not counted; a request that fails still gives its slot back.
* :class:`BodyTimeouts`: a stalled body is answered 408 (``Connection: close``), the app sees the
  client gone and its own answer is dropped; a body behind the minimum rate is answered 408 naming the
  rate; a complete body is never timed out, however long the app waits afterwards.
* :func:`read_plan_budget`, :func:`mark_answered`, :func:`was_answered`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from ckptd.service.auth import ANONYMOUS, Principal
from ckptd.service.limits import (
    ANSWER_PER_REQUEST, CHUNKS_PER_REQUEST, BodyTimeouts, PrincipalRequests, UploadSlots, mark_answered,
    read_plan_budget, was_answered,
)
from ckptd_schemas import TooManyRequests

NEVER = 3600.0  # a receive that does not return within any bound of these tests


def _scope(principal: Principal | None = None, path: str = "/v1/runs", method: str = "GET",
           headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    state = {"request_id": "req-1"}
    if principal is not None:
        state["principal"] = principal
    return {"type": "http", "method": method, "path": path, "headers": headers or [], "state": state}


def _answer(sent: list[dict]) -> tuple[int, dict[bytes, bytes], dict]:
    """Status, headers and JSON body of what a middleware or app sent."""
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body) if body else {}


async def _ok(send: Any, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


# -- read_plan_budget, mark_answered --------------------------------------------------------------------


def test_the_read_plan_budget_grows_with_the_regions_named():
    b = read_plan_budget(1000, base_chunks=5, base_answer=7)
    assert (b.max_chunks, b.max_answer) == (5 + CHUNKS_PER_REQUEST * 1000, 7 + ANSWER_PER_REQUEST * 1000)
    assert "CKPTD_READ_PLAN_CHUNK_BUDGET" in b.setting and "CKPTD_READ_PLAN_ANSWER_BUDGET" in b.setting
    empty = read_plan_budget(0, base_chunks=5, base_answer=7)
    assert (empty.max_chunks, empty.max_answer) == (5, 7)


def test_an_answer_is_marked_on_the_request_scope():
    scope: dict = {"type": "http"}
    assert not was_answered(scope)
    mark_answered(scope)
    assert was_answered(scope) and scope["state"]["ckptd_answered"] is True
    assert not was_answered({"type": "http", "state": {}})


# -- UploadSlots -------------------------------------------------------------------------------------


def test_upload_slots_refuse_the_token_over_its_limit_naming_token_file_and_limit():
    slots = UploadSlots(2)
    with contextlib.ExitStack() as alice, contextlib.ExitStack() as bob:
        first = alice.enter_context(contextlib.ExitStack())
        first.enter_context(slots.held("alice", "a0.bin"))
        alice.enter_context(slots.held("alice", "a1.bin"))
        with pytest.raises(TooManyRequests) as e:
            alice.enter_context(slots.held("alice", "a2.bin"))
        assert e.value.status == 429
        assert e.value.details == {"limit": 2, "token": "alice", "file": "a2.bin", "limit_name": "uploads"}
        assert "'alice'" in e.value.message and "'a2.bin'" in e.value.message
        assert "CKPTD_MAX_UPLOADS_PER_PRINCIPAL" in e.value.message
        bob.enter_context(slots.held("bob", "b0.bin"))  # another token is not held back
        assert (slots._active.get("alice", 0), slots._active.get("bob", 0)) == (2, 1)
        first.close()  # one upload ends: its slot, and only its, is given back
        assert slots._active.get("alice", 0) == 1
        alice.enter_context(slots.held("alice", "a3.bin"))
        with pytest.raises(TooManyRequests):
            alice.enter_context(slots.held("alice", "a4.bin"))
        bob.close()
        assert "bob" not in slots._active  # no entry left behind per token
    assert slots._active == {}  # every slot given back, the refused ones never taken


def test_an_upload_that_fails_gives_its_slot_back():
    slots = UploadSlots(1)
    with pytest.raises(OSError), slots.held("alice", "a0.bin"):
        raise OSError("the store failed mid-upload")
    with slots.held("alice", "a1.bin"):
        assert slots._active == {"alice": 1}


def test_upload_slots_without_a_limit_never_refuse():
    slots = UploadSlots(0)
    with contextlib.ExitStack() as stack:
        for i in range(100):
            stack.enter_context(slots.held("alice", f"f{i}.bin"))
        assert slots._active.get("alice", 0) == 100


# -- PrincipalRequests ---------------------------------------------------------------------------------


class _HeldApp:
    """An app whose requests stay in progress until released; counts what reached it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        if scope["path"] == "/boom":
            raise RuntimeError("handler failed")
        await self.release.wait()
        await _ok(send)


async def _drive(mw: Any, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await mw(scope, receive, send)
    return sent


def test_a_tokens_requests_over_the_limit_are_answered_429_before_the_app():
    alice, bob = Principal("alice"), Principal("bob")

    async def main() -> None:
        app = _HeldApp()
        mw = PrincipalRequests(app, limit=2, open_paths={"/healthz"})
        held = [asyncio.create_task(_drive(mw, _scope(alice, f"/held{i}"))) for i in range(2)]
        await asyncio.sleep(0)
        assert mw._active.get("alice", 0) == 2
        refused = await _drive(mw, _scope(alice, "/v1/runs/r/checkpoints"))
        status, headers, body = _answer(refused)
        assert status == 429 and headers[b"retry-after"] == b"1" and b"connection" not in headers
        err = body["error"]
        assert err["code"] == "too_many_requests" and err["request_id"] == "req-1"
        assert err["details"] == {"limit": 2, "token": "alice", "in_progress": 2, "limit_name": "requests"}
        assert "GET /v1/runs/r/checkpoints" in err["message"]
        with_body = await _drive(mw, _scope(alice, "/v1/x", "PUT", [(b"content-length", b"10")]))
        assert _answer(with_body)[1][b"connection"] == b"close"  # the unread body ends the connection
        assert app.seen == ["/held0", "/held1"]  # neither refusal reached the app
        # not counted: another token, an open path, an anonymous request, a request without a principal
        others = [asyncio.create_task(_drive(mw, s)) for s in
                  (_scope(bob, "/b"), _scope(alice, "/healthz"), _scope(ANONYMOUS, "/anon"), _scope(None, "/none"))]
        await asyncio.sleep(0)
        assert sorted(app.seen[2:]) == ["/anon", "/b", "/healthz", "/none"]
        assert (mw._active.get("alice", 0), mw._active.get("bob", 0)) == (2, 1)
        app.release.set()
        for sent in await asyncio.gather(*held, *others):
            assert _answer(sent)[0] == 200
        assert mw._active.get("alice", 0) == 0 and mw._active == {}
        assert _answer(await _drive(mw, _scope(alice, "/again")))[0] == 200

    asyncio.run(main())


def test_a_request_that_fails_gives_its_slot_back():
    async def main() -> None:
        app = _HeldApp()
        mw = PrincipalRequests(app, limit=1)
        with pytest.raises(RuntimeError):
            await _drive(mw, _scope(Principal("alice"), "/boom"))
        assert mw._active.get("alice", 0) == 0
        app.release.set()
        assert _answer(await _drive(mw, _scope(Principal("alice"), "/next")))[0] == 200

    asyncio.run(main())


def test_no_limit_counts_nothing():
    async def main() -> None:
        app = _HeldApp()
        mw = PrincipalRequests(app, limit=0)
        tasks = [asyncio.create_task(_drive(mw, _scope(Principal("alice"), f"/{i}"))) for i in range(5)]
        await asyncio.sleep(0)
        assert len(app.seen) == 5 and mw._active.get("alice", 0) == 0
        app.release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


# -- BodyTimeouts ----------------------------------------------------------------------------------------


class _BodyApp:
    """Reads the whole body as a route does, then answers 200 (its answer after a disconnect is dropped)."""

    def __init__(self, then_wait: bool = False) -> None:
        self.messages: list[dict] = []
        self.then_wait = then_wait

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            self.messages.append(msg)
            if msg["type"] != "http.request" or not msg.get("more_body"):
                break
        if self.then_wait and msg["type"] == "http.request":  # as a streaming answer waits for the disconnect
            self.messages.append(await receive())
        await _ok(send)


def _receiver(pieces: list[bytes], *, then: float | None = None, after: dict | None = None) -> Any:
    """A client that sends ``pieces`` (the last without ``more_body`` unless ``then``), then stalls ``then``
    seconds, then sends ``after``."""
    queue = list(pieces)

    async def receive() -> dict:
        if queue:
            piece = queue.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(queue) or then is not None}
        await asyncio.sleep(then if then is not None else 0)
        return after or {"type": "http.disconnect"}

    return receive


async def _run(mw: BodyTimeouts, app_scope: dict, receive: Any) -> list[dict]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    await mw(app_scope, receive, send)
    return sent


def test_a_stalled_body_is_answered_408_and_the_app_sees_the_client_gone():
    app = _BodyApp()
    mw = BodyTimeouts(app, idle_seconds=0.05)
    scope = _scope(Principal("alice"), "/v1/checkpoints/r/1/sessions/s/files/f", "PUT")
    sent = asyncio.run(_run(mw, scope, _receiver([b"x" * 10], then=NEVER)))
    status, headers, body = _answer(sent)
    assert status == 408 and headers[b"connection"] == b"close"
    assert body["error"]["code"] == "request_timeout" and body["error"]["details"] == {"timeout_s": 0.05}
    assert "CKPTD_BODY_IDLE_TIMEOUT_SECONDS" in body["error"]["message"]
    assert [m["type"] for m in app.messages] == ["http.request", "http.disconnect"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # the app's 200 dropped
    assert was_answered(scope)  # the disconnect the app met is the service's own answer


def test_a_body_behind_the_minimum_rate_is_answered_408_naming_the_rate():
    app = _BodyApp()
    mw = BodyTimeouts(app, idle_seconds=0, min_rate=1000, grace_seconds=0.05)
    sent = asyncio.run(_run(mw, _scope(Principal("alice"), "/up", "PUT"), _receiver([b"y" * 10], then=NEVER)))
    status, _, body = _answer(sent)
    assert status == 408
    details = body["error"]["details"]
    assert details["received"] == 10 and details["min_bytes_per_second"] == 1000
    assert "CKPTD_BODY_MIN_BYTES_PER_SECOND" in body["error"]["message"]
    assert app.messages[-1]["type"] == "http.disconnect"


def test_a_body_that_arrives_is_never_timed_out_even_when_the_app_waits_after_it():
    app = _BodyApp(then_wait=True)
    mw = BodyTimeouts(app, idle_seconds=5, min_rate=1000, grace_seconds=5)
    gone = {"type": "http.disconnect", "from": "the client"}
    sent = asyncio.run(_run(mw, _scope(Principal("alice"), "/up", "PUT"),
                            _receiver([b"a" * 100, b"b" * 100], after=gone)))
    assert _answer(sent)[0] == 200
    assert b"".join(m.get("body", b"") for m in app.messages) == b"a" * 100 + b"b" * 100
    # after the body the app waits past both bounds and gets the client's own message, not a 408
    mw2 = BodyTimeouts(_BodyApp(then_wait=True), idle_seconds=0.05)
    slow_close = _receiver([b"c" * 10], after=gone)

    async def then_slow() -> dict:
        msg = await slow_close()
        if msg["type"] == "http.disconnect":
            await asyncio.sleep(0.2)  # longer than the idle bound: it must not matter any more
        return msg

    sent2 = asyncio.run(_run(mw2, _scope(Principal("alice"), "/up", "PUT"), then_slow))
    assert _answer(sent2)[0] == 200 and mw2.app.messages[-1] is gone


def test_no_bound_and_non_http_scopes_pass_through():
    seen: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        assert receive is stalled  # not wrapped

    async def stalled() -> dict:
        await asyncio.sleep(NEVER)
        return {}

    asyncio.run(BodyTimeouts(app, idle_seconds=0.05)({"type": "lifespan"}, stalled, None))
    asyncio.run(BodyTimeouts(app, idle_seconds=0, min_rate=0)(_scope(), stalled, None))
    assert seen == ["lifespan", "http"]


def test_a_grace_of_zero_still_accepts_a_body_that_is_already_there():
    app = _BodyApp()
    mw = BodyTimeouts(app, idle_seconds=60, min_rate=1024, grace_seconds=0)
    sent = asyncio.run(_run(mw, _scope(Principal("alice"), "/up", "PUT"), _receiver([b"z" * 100])))
    assert _answer(sent)[0] == 200
    assert app.messages[0]["body"] == b"z" * 100
