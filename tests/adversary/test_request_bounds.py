"""A read token cannot make one request cost the service unbounded memory, and the probes answer
whatever the requests and the store do. Against a real ``ckptd serve``, with a read-only token:

* read-plan requests of one-element regions at the former body limit (64 MiB, declared or
  streamed), at the size that took 1.3 GB and 23 s (12 MiB), and just under the read body limit
  with more regions than ``CKPTD_READ_PLAN_MAX_REQUESTS`` are refused 413, naming the field and
  the setting; a request of as many regions as the limit allows is planned. The service's peak
  memory (``VmHWM``) grows by a bounded amount over all of it, and ``/healthz`` and ``/readyz``,
  probed meanwhile from another thread, answer every time;
* with the S3 store answering every request 503 SlowDown (which the service's own calls retry for a
  minute or more), ``/readyz`` answers 503 with the store's cause at once, and so does a long poll
  (``?wait=599``; 175 s before); with a store that answers nothing, ``/readyz`` answers 503 naming
  the probe's deadline; with the store well, a long poll on a session that does not exist is
  answered 404 at once.

The deadlines here are hang guards (scaled by ``CKPTD_TEST_TIME_SCALE``), never timings.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from adversary.test_requests import ALICE, _commit_vector_of_single_chunks
from ckptd.service.auth import hash_token
from ckptd_schemas.api import MAX_READ_REQUESTS, READ_REQUEST_BYTES
from support import ServerProcess, scaled

READER = "reader-token-0123456789abcdef"
TOKENS = f"alice sha256:{hash_token(ALICE)} write:*;reader sha256:{hash_token(READER)} read:*"
#: How long a probe may take before it counts as hung (a probe behind the old 12 MiB plan took 10 s).
PROBE_S = scaled(5.0)
#: The most the service's peak memory may grow over every attack below: generous (a plan of the
#: largest allowed request takes under 100 MB), and far under the 1.3 GB one 12 MiB request took.
PEAK_GROWTH_BYTES = 512 << 20


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def _regions(n: int, tensor_chunks: int) -> bytes:
    """A read-plan body of ``n`` one-element regions of the vector ``w``."""
    return json.dumps({"requests": [{"name": "w", "offsets": [i % tensor_chunks], "sizes": [1]}
                                    for i in range(n)]}).encode()


def _streamed(body: bytes, piece: int = 1 << 20) -> Iterator[bytes]:
    for i in range(0, len(body), piece):
        yield body[i:i + piece]


class _Prober(threading.Thread):
    """Probes ``/healthz`` and ``/readyz`` in turn until stopped; records each answer's status, or the
    hang (a probe that took longer than :data:`PROBE_S`)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answers, self.stop = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=PROBE_S) as c:
            while not self.stop.is_set():
                for path in ("/healthz", "/readyz"):
                    try:
                        self.answers.append((path, c.get(f"{self.url}{path}").status_code))
                    except httpx.TimeoutException:
                        self.answers.append((path, "hung"))
                time.sleep(0.05)


def _refused(r: httpx.Response, field: str) -> dict:
    assert r.status_code == 413, r.text[:400]
    err = r.json()["error"]
    assert err["code"] == "payload_too_large", err
    assert err["details"]["field"] == field and err["details"]["max_requests"] == MAX_READ_REQUESTS, err
    assert "CKPTD_READ_PLAN_MAX_REQUESTS" in err["message"], err
    return err


def test_read_plans_at_and_past_the_limits_take_bounded_memory_while_the_probes_answer(tmp_path):
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS": TOKENS}, log=tmp_path / "server.log").start()
    prober = _Prober(srv.url)
    try:
        n = _commit_vector_of_single_chunks(srv.url)
        url = f"{srv.url}/v1/checkpoints/gpt/1/read-plan"
        auth = {"Authorization": f"Bearer {READER}", "Content-Type": "application/json"}
        assert httpx.post(url, content=_regions(10, n), headers=auth, timeout=30).status_code == 200
        assert srv.proc is not None
        before = _peak_rss(srv.proc.pid)
        prober.start()
        with httpx.Client(timeout=scaled(120)) as c:
            # the former body limit, declared: refused before a byte of it is read
            r = c.post(url, content=b" " * (64 << 20), headers=auth)
            _refused(r, "body")
            # 12 MiB of 292,625 regions (1.3 GB and 23 s before), streamed without a declared length
            big = _regions(292_625, n)
            assert 12 << 20 < len(big) < 14 << 20
            _refused(c.post(url, content=_streamed(big), headers=auth), "body")
            # just under the body limit, ~110,000 regions: counted, not parsed
            many = _regions(MAX_READ_REQUESTS * READ_REQUEST_BYTES // 38, n)
            many = many[:MAX_READ_REQUESTS * READ_REQUEST_BYTES - 64].rsplit(b"},", 1)[0] + b"}]}"
            err = _refused(c.post(url, content=many, headers=auth), "requests")
            assert err["details"]["needed"] > MAX_READ_REQUESTS
            # as many regions as one request may name: planned
            r = c.post(url, content=_regions(MAX_READ_REQUESTS, n), headers=auth)
            assert r.status_code == 200 and len(r.json()["copies"]) == MAX_READ_REQUESTS, r.text[:300]
            # and one more: refused
            _refused(c.post(url, content=_regions(MAX_READ_REQUESTS + 1, n), headers=auth), "requests")
        time.sleep(0.3)
        prober.stop.set()
        prober.join(PROBE_S * 2)
        growth = _peak_rss(srv.proc.pid) - before
        print(f"\npeak memory growth {growth / 2**20:.0f} MiB over the attacks; {len(prober.answers)} probes")
        assert growth < PEAK_GROWTH_BYTES, growth
        assert prober.answers and all(status == 200 for _, status in prober.answers), prober.answers
    finally:
        prober.stop.set()
        srv.stop()


@pytest.fixture
def s3_proxy(moto_s3):
    from s3_server import FaultProxy

    with FaultProxy(moto_s3) as proxy:
        yield proxy


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_readyz_answers_at_once_while_s3_fails_or_hangs_and_a_long_poll_on_no_session_is_404(
        moto_s3, s3_proxy, tmp_path):
    from s3_server import FaultRule, aws_env

    root = moto_s3.url()
    srv = ServerProcess(root, env={"CKPTD_TOKENS": TOKENS, **aws_env(s3_proxy.endpoint)},
                        log=tmp_path / "server.log").start()
    alice = {"Authorization": f"Bearer {ALICE}"}
    try:
        with httpx.Client(timeout=PROBE_S) as c:  # every call below answers within the hang guard
            assert c.get(f"{srv.url}/readyz").status_code == 200
            r = c.get(f"{srv.url}/v1/checkpoints/gpt/1/sessions/nope?wait=599", headers=alice)
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
            r = c.post(f"{srv.url}/v1/checkpoints/gpt/1/sessions", headers=alice,
                       json={"session": "s1", "world_size": 2, "step": 1})
            assert r.status_code == 200, r.text
            r = c.get(f"{srv.url}/v1/checkpoints/gpt/1/sessions/s2?wait=599", headers=alice)
            assert r.status_code == 404 and r.json()["error"]["details"]["session"] == "s2", r.text

            rule = s3_proxy.add(FaultRule(lambda m, p, q: True, 503, "SlowDown", times=1 << 30))
            time.sleep(5.2)  # the last probe's outcome answers for 5 s (readiness.PROBE_SECONDS)
            for need in ("writes", "reads"):
                r = c.get(f"{srv.url}/readyz", params={"for": need})
                body = r.json()
                assert r.status_code == 503 and body["status"] == "not ready" and not body["readable"], r.text
                # the store's own answer (s3fs says a 503 SlowDown as EBUSY with the store's message)
                assert body["error"]["code"] == "storage" and "injected by the test proxy" in body["reason"], r.text
            assert rule.hits <= 8  # one attempt per call: no retry storm
            # a long poll: its first read is tried once, so the store's failure is said at once (clients retry)
            r = c.get(f"{srv.url}/v1/checkpoints/gpt/1/sessions/nope?wait=599", headers=alice)
            assert r.status_code == 503 and r.json()["error"]["code"] == "storage", r.text

            s3_proxy.log.clear()
            rule.times = 0
            s3_proxy._srv.delay = scaled(30)  # a store that answers nothing for 30 s
            time.sleep(5.2)
            r = c.get(f"{srv.url}/readyz")
            assert r.status_code == 503 and "did not answer the readiness probe" in r.json()["reason"], r.text
    finally:
        s3_proxy._srv.delay = 0
        srv.stop()
