"""``ckptd_schemas.errors``: the tree its docstring draws is the class tree, and every error crosses the wire.

The docstring is the one table of codes and statuses a reader (and the docs) go by: each line's class,
status and code must be the class's own, each class's parent the one drawn above it, and every class
of the module drawn once. ``to_body`` then ``error_from_body`` (through JSON, as the client gets it)
gives back the same class, message, details and the request id; a body without a code (a proxy's
answer, FastAPI's own 422) becomes the class its status stands for. Pure: no service.
"""

from __future__ import annotations

import json
import re

import pytest

from ckptd_schemas import errors
from ckptd_schemas.errors import CkptdError, error_from_body

LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z][A-Za-z]+)\s+(?P<status>\d{3})\s+(?P<code>[a-z_]+)")


def _drawn() -> list[tuple[str, str | None, int, str]]:
    """(class, parent drawn above it, status, code) for every line of the docstring's tree."""
    doc = errors.__doc__
    tree = doc[doc.index("::") + 2:doc.index("Every error carries")]
    out: list[tuple[str, str | None, int, str]] = []
    stack: list[str] = []  # the names drawn at each depth so far
    for line in tree.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        depth = (len(m["indent"]) - 4) // 4
        del stack[depth:]
        out.append((m["name"], stack[-1] if stack else None, int(m["status"]), m["code"]))
        stack.append(m["name"])
    return out


def _classes() -> dict[str, type[CkptdError]]:
    return {n: getattr(errors, n) for n in errors.__all__
            if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), CkptdError)}


def test_the_docstring_draws_every_error_class_once():
    names = [d[0] for d in _drawn()]
    assert len(names) == len(set(names)), names
    assert set(names) == set(_classes())
    # and nothing in the module derives from CkptdError without being exported (and so drawn)
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, CkptdError)}
    assert defined == set(_classes())


@pytest.mark.parametrize("drawn", _drawn(), ids=lambda d: d[0])
def test_each_drawn_line_is_the_class(drawn):
    name, parent, status, code = drawn
    cls = _classes()[name]
    assert (cls.status, cls.code) == (status, code)
    if parent is None:
        assert cls is CkptdError
    else:
        assert cls.__bases__ == (_classes()[parent],), f"{name} derives from {cls.__bases__}, drawn under {parent}"


def test_codes_are_unique():
    codes = [c.code for c in _classes().values()]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", list(_classes().values()), ids=lambda c: c.__name__)
def test_every_error_crosses_the_wire_as_itself(cls):
    sent = cls(f"file 'r0.bin' of gpt/1: {cls.__name__}", file="r0.bin", ranks=[0, 3], nested={"k": [1.5, None]})
    body = sent.to_body()
    assert set(body) == {"error"} and body["error"]["code"] == cls.code
    body["error"]["request_id"] = "req-0123"  # the service adds its request id to every error body
    got = error_from_body(json.loads(json.dumps(body)), cls.status)
    assert type(got) is cls
    assert (got.message, str(got), got.details) == (sent.message, str(sent), sent.details)
    assert got.request_id == "req-0123"
    # the code decides the class, whatever status a proxy in between answered with
    assert type(error_from_body(json.loads(json.dumps(sent.to_body())), 502)) is cls


def test_a_body_with_a_code_keeps_what_parses_and_drops_the_rest():
    got = error_from_body({"error": {"code": "checksum_mismatch", "message": 7, "details": ["not", "a dict"],
                                     "request_id": 5}}, 422)
    assert type(got) is errors.ChecksumMismatch
    assert got.message == "7" and got.details == {} and got.request_id is None
    got = error_from_body({"error": {"code": "no_such_code", "message": "m", "details": {"a": 1}}}, 409)
    assert type(got) is CkptdError and got.details == {"a": 1}


@pytest.mark.parametrize(("status", "cls"), [
    (401, errors.Unauthorized), (403, errors.Forbidden), (400, errors.InvalidRequest), (422, errors.InvalidRequest),
    (404, errors.NotFound), (429, errors.TooManyRequests), (507, errors.StoragePermanent), (500, CkptdError),
    (502, CkptdError), (503, CkptdError),
])
def test_a_body_without_a_code_becomes_the_class_of_its_status(status, cls):
    for body in ({"detail": [{"msg": "field required"}]}, "<html>bad gateway</html>", None, {"error": "text"}):
        got = error_from_body(body, status)
        assert type(got) is cls, (status, body)
        assert str(status) in got.message or status == 404


@pytest.mark.parametrize("key", ["message", "self"])
def test_details_named_like_the_constructors_arguments_still_give_the_typed_error(key):
    got = error_from_body({"error": {"code": "session_conflict", "message": "m", "details": {key: "x"}}}, 409)
    assert type(got) is errors.SessionConflict
    assert got.message == "m" and got.details == {key: "x"}
