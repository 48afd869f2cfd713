"""Request bodies read by hand (an index, a read-plan request), shared by the upload and read routes.

A route reads the body with ``read_body_limited`` (413 past its limit), then
validates it with ``parse_body`` off the event loop (a bad body is a 4xx). A read-plan or load-tree
request is validated with ``parse_read_requests``: its regions are counted before it is parsed
(``count_objects``: validating costs about 30 times the body in memory, whatever its limit says), so
a body of more regions than the limit is refused 413 at the cost of one pass over its bytes.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ckptd_schemas import InvalidRequest, PayloadTooLarge

__all__ = ["count_objects", "invalid", "parse_body", "parse_read_requests", "read_body_limited"]

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string, escapes included


def parse_body(model: type[BaseModel], raw: bytes, what: str, err: type[InvalidRequest] = InvalidRequest,
               **details: object) -> BaseModel:
    """Validate a JSON body read by hand: a bad body is the client's fault (4xx), never a 500."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid(e.errors(), f"{what} is invalid", err, **details) from None


def invalid(errors: Sequence[Any], said: str, err: type[InvalidRequest] = InvalidRequest,
            **details: object) -> InvalidRequest:
    """The typed error of a failed validation (a body read by hand, or FastAPI's of a request): ``said``,
    where the first error is and what it says; the first 20 errors in its details."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or "body"
    return err(f"{said} at {where}: {first.get('msg', 'invalid')}",
               errors=[{"loc": [str(p) for p in x.get("loc", ())], "msg": x.get("msg")} for x in errors[:20]],
               **details)


def count_objects(raw: bytes) -> int:
    """How many JSON objects ``raw`` holds (if it parses): its ``{`` outside strings (no copy of it)."""
    return raw.count(b"{") - sum(m.group().count(b"{") for m in _STRING.finditer(raw))


def parse_read_requests(model: type[BaseModel], raw: bytes, what: str, limit: int) -> BaseModel:
    """A read-plan or load-tree request (``model``: its ``requests``, regions, each a JSON object, and
    ``objects``, names) of at most ``limit`` of each; over it, 413 naming the field and the setting,
    the regions counted before anything is parsed."""
    def refuse(field: str, n: int) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"{what} names {n} {field}, over the limit of {limit} (CKPTD_READ_PLAN_MAX_REQUESTS): send them as "
            f"several requests", field=field, needed=n, limit=limit, setting="CKPTD_READ_PLAN_MAX_REQUESTS",
            max_requests=limit)

    # every "{" counted in one pass in C first; outside strings only when that is over (the body is one)
    if raw.count(b"{") > limit + 1 and (n := count_objects(raw) - 1) > limit:
        raise refuse("requests", n)
    body = parse_body(model, raw, what)
    for field in ("requests", "objects"):
        n = len(getattr(body, field, ()))
        if n > limit:
            raise refuse(field, n)
    return body


async def read_body_limited(request: Request, limit: int, why: str = "", **details: object) -> bytes:
    """The body, at most ``limit`` bytes (413 past it, saying ``why`` and ``details`` when given)."""
    declared = request.headers.get("content-length")
    by = f" ({why})" if why else ""
    if declared is not None and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}{by}", limit=limit, **details)
    buf = bytearray()
    async for piece in request.stream():
        buf += piece
        if len(buf) > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes{by}", limit=limit, **details)
    return bytes(buf)
