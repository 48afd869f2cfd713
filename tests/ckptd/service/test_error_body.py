"""The one error shape (:mod:`ckptd.service.error_body`), from every layer that answers an error.

* :func:`error_body`: ``{"error": {"code", "message", "details"[, "request_id"]}}``, which the client
  rebuilds into the same typed error (``error_from_body``) with its request id;
* :func:`raw_error_response`: a whole HTTP/1.1 response below the ASGI app, which a real HTTP parser
  (h11) reads as one response that closes the connection, its length exact, its status the error's
  unless given;
* :func:`send_error`: the same body from ASGI middleware, with the request's id and extra headers.
"""

from __future__ import annotations

import asyncio
import json

import h11
import pytest

from ckptd.service.error_body import error_body, error_bytes, raw_error_response, send_error
from ckptd_schemas import InvalidRequest, PayloadTooLarge, StorageFull, Unavailable, error_from_body


def test_the_body_round_trips_to_the_same_typed_error_with_its_request_id():
    err = StorageFull("disk full under /srv/ckpt", key="runs/r/1/x", root="/srv/ckpt")
    body = error_body(err, "req-7")
    assert body == {"error": {"code": "storage_full", "message": "disk full under /srv/ckpt",
                              "details": {"key": "runs/r/1/x", "root": "/srv/ckpt"}, "request_id": "req-7"}}
    back = error_from_body(json.loads(error_bytes(err, "req-7")), err.status)
    assert type(back) is StorageFull and back.details == err.details and back.request_id == "req-7"
    assert "request_id" not in error_body(err)["error"] and "request_id" not in error_body(err, "")["error"]
    assert b" " not in error_bytes(InvalidRequest("x", field="a"))  # compact JSON


def _parse(raw: bytes) -> tuple[h11.Response, bytes]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "ckptd")]))
    conn.receive_data(raw)
    events = []
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(b"")  # the server closes after its answer
            continue
        events.append(ev)
        if isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    resp = next(e for e in events if isinstance(e, h11.Response))
    body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
    assert isinstance(events[-1], h11.EndOfMessage)  # complete by its content-length, nothing more
    return resp, body


@pytest.mark.parametrize(("err", "status", "reason", "want"), [
    (PayloadTooLarge("request line and headers exceed 65536 bytes", limit=65536), 431,
     "Request Header Fields Too Large", 431),
    (Unavailable("over the connection cap, try again"), None, "Service Unavailable", 503),
    (InvalidRequest("malformed HTTP request: 'bad\\x00line'"), None, "", 400),
])
def test_a_raw_response_is_one_complete_http_answer_that_closes(err, status, reason, want):
    raw = raw_error_response(err, status, reason)
    resp, body = _parse(raw)
    headers = {k.decode(): v.decode() for k, v in resp.headers}
    assert resp.status_code == want and resp.reason.decode() == reason
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    back = error_from_body(json.loads(body), want)
    assert type(back) is type(err) and back.message == err.message and back.details == err.details


def test_send_error_answers_from_middleware_with_the_request_id_and_extra_headers():
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    err = PayloadTooLarge("body of 9 bytes exceeds the limit of 8", limit=8)
    asyncio.run(send_error(send, {"type": "http", "state": {"request_id": "req-9"}}, err, [(b"connection", b"close")]))
    start, body = sent
    assert start["status"] == 413
    headers = dict(start["headers"])
    assert headers[b"connection"] == b"close" and int(headers[b"content-length"]) == len(body["body"])
    assert json.loads(body["body"])["error"]["request_id"] == "req-9"
    sent.clear()
    asyncio.run(send_error(send, {"type": "http"}, err))  # a scope without state: no id, no failure
    assert "request_id" not in json.loads(sent[1]["body"])["error"]
