"""Request bodies read by hand (:mod:`ckptd.service.bodies`): a rank's index, a read-plan request.

* :func:`read_body_limited`: a body declared or streamed past the limit is ``PayloadTooLarge`` (413)
  naming the limit, and reading stops at the piece that crosses it; a body of exactly the limit, or
  an empty one, is read whole;
* :func:`parse_body`: a body that does not validate is the client's fault, the given typed error
  (``InvalidIndex`` for an index) naming where it is wrong and carrying the caller's details, never
  a pydantic ``ValidationError`` (a 500);
* :func:`parse_read_requests`: a read-plan or load-tree body of more regions (JSON objects, braces
  inside strings not counted) or object names than the limit is ``PayloadTooLarge`` naming the field
  and ``CKPTD_READ_PLAN_MAX_REQUESTS``; at the limit it parses.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

import json

from ckptd.service.bodies import count_objects, parse_body, parse_read_requests, read_body_limited
from ckptd.service.read_routes import LoadTreeBody, ReadPlanBody
from ckptd_schemas import InvalidIndex, InvalidRequest, PayloadTooLarge, RankIndex


def _request(pieces: list[bytes], declared: int | None = None) -> tuple[Request, list[int]]:
    """A request whose body arrives in ``pieces``; the list counts the pieces read."""
    read: list[int] = []
    queue = list(pieces)

    async def receive() -> dict:
        read.append(1)
        piece = queue.pop(0) if queue else b""
        return {"type": "http.request", "body": piece, "more_body": bool(queue)}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "PUT", "path": "/x", "headers": headers}, receive), read


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    req, read = _request([b"x" * 20], declared=20)
    with pytest.raises(PayloadTooLarge) as e:
        asyncio.run(read_body_limited(req, 10))
    assert e.value.status == 413 and e.value.details == {"limit": 10}
    assert "body of 20 bytes exceeds the limit of 10" in e.value.message
    assert read == []  # nothing of the body was read


def test_a_streamed_body_over_the_limit_stops_at_the_piece_that_crosses_it():
    req, read = _request([b"a" * 4, b"b" * 4, b"c" * 4, b"d" * 4])  # no length declared (chunked)
    with pytest.raises(PayloadTooLarge) as e:
        asyncio.run(read_body_limited(req, 10))
    assert e.value.details == {"limit": 10} and "exceeds the limit of 10 bytes" in e.value.message
    assert len(read) == 3  # the fourth piece is never read


def test_a_body_of_exactly_the_limit_or_empty_is_read_whole():
    req, _ = _request([b"a" * 4, b"b" * 6], declared=10)
    assert asyncio.run(read_body_limited(req, 10)) == b"a" * 4 + b"b" * 6
    req, _ = _request([b""], declared=0)
    assert asyncio.run(read_body_limited(req, 10)) == b""


def test_an_index_that_does_not_validate_is_invalid_index_naming_where():
    raw = b'{"rank": 0, "world_size": 2, "files": [], "tensors": [{"name": "model.w", "shape": [2], ' \
          b'"dtype": "float33", "group": "model", "chunks": []}]}'
    with pytest.raises(InvalidIndex) as e:
        parse_body(RankIndex, raw, "index of rank 0", InvalidIndex, rank=0)
    err = e.value
    assert err.status == 422 and err.message.startswith("index of rank 0 is invalid at tensors.0.dtype: ")
    assert "float33" in err.message  # the dtype check names the value (and the tensor)
    assert err.details["rank"] == 0 and err.details["errors"][0]["loc"] == ["tensors", "0", "dtype"]


def test_a_body_that_is_not_json_is_invalid_request_at_the_body():
    with pytest.raises(InvalidRequest) as e:
        parse_body(RankIndex, b"{not json", "read-plan request")
    assert type(e.value) is InvalidRequest and e.value.status == 400
    assert e.value.message.startswith("read-plan request is invalid at body: ")
    assert len(e.value.details["errors"]) == 1


def test_only_the_first_twenty_errors_are_carried():
    raw = b'{"rank": 0, "world_size": 1, "files": [], "tensors": [' + b",".join([b"{}"] * 30) + b"]}"
    with pytest.raises(InvalidRequest) as e:
        parse_body(RankIndex, raw, "index of rank 0")
    assert len(e.value.details["errors"]) == 20


def test_objects_are_counted_outside_strings():
    assert count_objects(b'{"a": [{"n": "x{y\\"{"}, {}]}') == 3
    assert count_objects(b'[]') == 0


def test_a_read_request_over_the_limit_is_refused_naming_the_field_and_the_setting():
    def body(n: int, name: str = "w", **more: object) -> bytes:
        return json.dumps({"requests": [{"name": name}] * n, **more}).encode()

    assert len(parse_read_requests(ReadPlanBody, body(4), "read-plan request", 4).requests) == 4
    assert len(parse_read_requests(ReadPlanBody, body(4, "{{{{"), "read-plan request", 4).requests) == 4
    for raw, model, field in ((body(5), ReadPlanBody, "requests"),
                              (body(1, objects=["o"] * 5), LoadTreeBody, "objects")):
        with pytest.raises(PayloadTooLarge) as e:
            parse_read_requests(model, raw, "read-plan request", 4)
        assert e.value.details["field"] == field and e.value.details["max_requests"] == 4
        assert "CKPTD_READ_PLAN_MAX_REQUESTS" in e.value.message
