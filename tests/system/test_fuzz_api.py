"""Bad input, generated: every OpenAPI operation driven by schemathesis (valid and invalid data) and
hypothesis-built rank indexes with hostile values; never a 5xx, always a message, the server stays
up, nothing is written outside the root, and a committed checkpoint stays loadable."""

from __future__ import annotations

import json
import math
import uuid

import httpx
import pytest
import schemathesis
import torch
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from ckptd_client import CheckpointClient
from support import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    srv = ServerProcess(base / "root").start()
    good = {"w": torch.arange(12.0).reshape(3, 4)}
    c = CheckpointClient(srv.url)
    c.save(good, "fuzz/1").wait()
    c.close()
    yield srv, base, good, {p.name for p in base.iterdir()}
    srv.stop()


@pytest.fixture(scope="module")
def served_operations(live) -> dict:
    """Every operation of the OpenAPI document the live server serves, by label (read once)."""
    schema = schemathesis.openapi.from_url(f"{live[0].url}/openapi.json")
    return {o.ok().label: o.ok() for o in schema.get_all_operations()}


def _operations() -> list[str]:
    """Every operation in the service's OpenAPI document (built from the app, no server needed)."""
    return sorted(op.ok().label for op in schemathesis.openapi.from_dict(_openapi()).get_all_operations())


def _openapi() -> dict:
    import tempfile

    from ckptd.service.app import create_app
    from ckptd.service.settings import Settings

    return create_app(Settings(root=tempfile.mkdtemp(prefix="ckptd-openapi-"))).openapi()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", _operations())
def test_no_operation_answers_5xx(live, served_operations, label, mode):
    srv = live[0]
    op = served_operations[label]

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        case.call_and_validate(base_url=srv.url, checks=[not_a_server_error])

    try:
        run()
    except Unsatisfiable:  # e.g. a DELETE whose only inputs are free-form path strings
        pytest.skip(f"schemathesis cannot express {mode.value} input for {label}")


def _after(live) -> None:
    """The server is up, the good checkpoint loads, nothing appeared outside the root."""
    srv, base, good, before = live
    assert httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
    c = CheckpointClient(srv.url)
    got = {"w": torch.zeros(3, 4)}
    c.load(got, "fuzz/latest")
    c.close()
    assert torch.equal(got["w"], good["w"])
    assert {p.name for p in base.iterdir()} == before  # hostile names wrote nothing beside the root


hostile_int = st.one_of(st.integers(-(2**70), -1), st.integers(2**62, 2**70), st.just(0), st.integers(1, 8))
hostile_name = st.one_of(st.text(min_size=0, max_size=8), st.just("../../etc/passwd"), st.just("a" * 5000),
                         st.just("model.w\x00"), st.just("model.w"))
hostile_float = st.one_of(st.just(math.nan), st.just(math.inf), st.floats(allow_nan=False))


@st.composite
def rank_indexes(draw) -> dict:
    chunk = {"kind": draw(st.sampled_from(["box", "flat", "bogus"])), "rank": draw(hostile_int),
             "offsets": draw(st.lists(hostile_int, max_size=3)), "sizes": draw(st.lists(hostile_int, max_size=3)),
             "start": draw(hostile_int), "length": draw(hostile_int),
             "location": {"file": draw(st.sampled_from(["r000000-0000.bin", "../x.bin", "", "f" * 300])),
                          "offset": draw(hostile_int), "length": draw(hostile_int),
                          "raw_length": draw(hostile_int), "xxh3": draw(st.sampled_from(["0" * 16, "zz", ""])),
                          "codec": draw(st.sampled_from(["raw", "zstd", "lz4"]))}}
    tensor = {"name": draw(hostile_name), "shape": draw(st.lists(hostile_int, max_size=3)),
              "dtype": draw(st.sampled_from(["float32", "bfloat16", "float128", "", "complex64"])),
              "group": draw(hostile_name), "chunks": [chunk]}
    body = {"rank": draw(hostile_int), "world_size": draw(hostile_int), "tensors": [tensor],
            "files": draw(st.lists(st.sampled_from(["r000000-0000.bin", "../../x", "ok.bin"]), max_size=2)),
            "param_groups": [{"index": 0, "params": ["w"], "hyperparams": {"lr": draw(hostile_float)}}]}
    if draw(st.booleans()):
        body["unexpected"] = 1
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=rank_indexes())
def test_hostile_rank_indexes_are_4xx_with_a_message(live, body):
    srv = live[0]
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        name = uuid.uuid4().hex[:8]
        sid = uuid.uuid4().hex
        r = http.post(f"/v1/checkpoints/fuzz2/{name}/sessions", json={"session": sid, "world_size": 1, "step": 1})
        assert r.status_code in (200, 201), r.text
        data = b"\x01" * 256
        r = http.put(f"/v1/checkpoints/fuzz2/{name}/sessions/{sid}/files/r000000-0000.bin", content=data,
                     headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
        assert r.status_code in (200, 201), r.text
        r = http.put(f"/v1/checkpoints/fuzz2/{name}/sessions/{sid}/ranks/0", content=json.dumps(body),
                     headers={"content-type": "application/json"})  # NaN/Infinity tokens as a client may send
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        err = r.json()
        assert err.get("error", {}).get("message") or err.get("message") or err.get("detail"), err


def test_the_server_survived_and_the_good_checkpoint_loads(live):
    _after(live)
