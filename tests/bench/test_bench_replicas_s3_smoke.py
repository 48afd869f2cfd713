"""Two replicas on one S3 root (bench/replicas.py ``--s3``, the node-local layout) still run, tiny: each
receives half of the ranks' files over its co-located socket and hashes them as they arrive, the commit
confirms them without reading them back, the re-read after the marker covers every byte, and with one
replica SIGKILLed mid-save the checkpoint still commits (through the other) and loads bit for bit."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_replicas_s3_runs_small(tmp_path):
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    out = tmp_path / "replicas_s3.json"
    proc = run_bench("bench.replicas", "--s3", "--mib", "8", "--repeat", "1", "--out", str(out),
                     "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    plain, killed = res["checkpoints"]
    for c in (plain, killed):
        assert c["loaded_bit_exact"] and c["reread"]["ok"], c
        assert c["reread"]["bytes_read"] >= res["mib"] * 2**20 * 0.99, c  # every byte re-read after the marker
        assert c["ways"]["direct"] == 0 and c["ways"]["socket"] > 0, c
    # Without a kill, each replica received and hashed its own ranks' half; the one that committed
    # confirmed every byte as checked on arrival and read none back.
    (by,) = plain["committed_by"]
    for name, r in plain["replicas"].items():
        assert r["socket_in"] > 0 and r["data_in"] < res["mib"] * 2**20, (name, r)
    assert plain["replicas"][by]["on_arrival"] >= res["mib"] * 2**20 * 0.99 and plain["replicas"][by]["read_back"] == 0
    # The killed save: B died (not to be scraped after), A committed it.
    assert killed["kill"] and killed["replicas"]["B"] is None and killed["committed_by"] == "A", killed
    assert res["kill"]["killed_at"] > 0
    assert "B SIGKILLed" in proc.stdout
