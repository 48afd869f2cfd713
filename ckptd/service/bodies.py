"""Request bodies read by hand (an index, a read-plan request), shared by the upload and read routes.

A route reads the body with ``read_body_limited`` (413 past its limit), then
validates it with ``parse_body`` off the event loop (a bad body is a 4xx).
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ckptd_schemas import InvalidRequest, PayloadTooLarge

__all__ = ["parse_body", "read_body_limited"]


def parse_body(model: type[BaseModel], raw: bytes, what: str, err: type[InvalidRequest] = InvalidRequest,
               **details: object) -> BaseModel:
    """Validate a JSON body read by hand: a bad body is the client's fault (4xx), never a 500."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise err(f"{what} is invalid at {where}: {first.get('msg', 'invalid')}",
                  errors=[{"loc": [str(p) for p in x.get("loc", ())], "msg": x.get("msg")} for x in errors[:20]],
                  **details) from None


async def read_body_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}", limit=limit)
    buf = bytearray()
    async for piece in request.stream():
        buf += piece
        if len(buf) > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes", limit=limit)
    return bytes(buf)
