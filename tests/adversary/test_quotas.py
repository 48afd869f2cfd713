"""Attacks on the root's space: one run's writer filling it so that every other run's save fails.

Threat (docs/security.md, Quotas and the reserve): a holder of a write token saves without end, or
saves one huge checkpoint, and the root fills; every other run's save then fails with 507 until the
filler's sessions are reclaimed, and a save in progress cannot even write its manifest. Two defences,
each attacked here through the public surface (a real ``ckptd serve``, real clients, a real small
filesystem where the disk must fill):

* a token's quota (``quota=`` in its tokens line): the filler gets 507 ``quota_exceeded`` at once,
  naming its token, quota and holding, while another token's save commits beside it; what it holds
  is measured on the root (committed checkpoints count, a restart forgets nothing, deleted ones stop
  counting);
* the root's reserve (``CKPTD_ROOT_RESERVE``): a writer without a quota fills the disk down to the
  reserve and no further (507 ``reserve_reached``, then again at once), and another run's save whose
  data had arrived still commits into the reserve; the last good checkpoint loads.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
import torch
import xxhash

from ckptd.store.space import RECHECK_SECONDS
from ckptd_client import CheckpointClient, QuotaExceeded, ReserveReached, StorageFull
from ckptd_client._save import build_snapshot, upload_files
from ckptd_client.session_calls import open_session, put_index, wait_committed
from ckptd_client.transport import Transport
from support import ServerProcess, assert_bits_equal, blank_like, make_state, scaled, small_tmpfs

KIB, MIB = 1 << 10, 1 << 20
FILLER, SAVER = "filler-token-0123456789", "saver-token-0123456789"
TOKENS = f"filler {FILLER} write:fill* quota=2MiB; saver {SAVER} write:good*"


def loads(client: CheckpointClient, ref: str, want: dict) -> None:
    got = blank_like(want)
    client.load(got, ref)
    assert_bits_equal(got, want)


def saved(client: CheckpointClient, sd: dict, ref: str) -> None:
    assert client.save(sd, ref).wait(timeout=scaled(60)).state == "committed"


def test_a_writer_past_its_quota_is_refused_at_once_while_another_token_saves(tmp_path):
    root = tmp_path / "root"
    srv = ServerProcess(root, env={"CKPTD_TOKENS": TOKENS}, log=tmp_path / "server.log").start()
    # Retries for 10 minutes: a refusal that were retried would outlast every wait below.
    filler = CheckpointClient(srv.url, token=FILLER, retry_seconds=600, streams=1, file_bytes=128 * KIB)
    saver = CheckpointClient(srv.url, token=SAVER, retry_seconds=600)
    try:
        kept = {n: make_state(n, mib=0.75) for n in (1, 2)}
        for n, sd in kept.items():  # 1.5 MiB committed: within the quota, one at a time
            saved(filler, sd, f"fill/{n}")
        good = {n: make_state(10 + n, mib=0.75) for n in (1, 2, 3)}

        # The filler's third checkpoint would take it past 2 MiB: refused, while the saver's saves commit.
        other = saver.save(good[1], "good/1")
        with pytest.raises(QuotaExceeded) as ei:
            filler.save(make_state(3, mib=0.75), "fill/3").wait(timeout=scaled(60))
        err = ei.value
        assert isinstance(err, StorageFull) and err.status == 507 and err.code == "quota_exceeded"
        assert err.details["token"] == "filler" and err.details["quota"] == 2 * MIB, err.details
        assert 1.5 * MIB <= err.details["held"] <= 2 * MIB and err.details["run"] == "fill", err.details
        assert "'filler'" in err.message and str(2 * MIB) in err.message and FILLER not in err.message
        assert other.wait(timeout=scaled(60)).state == "committed"
        saved(saver, good[2], "good/2")  # the other token keeps saving, past the filler's quota itself

        # Over HTTP too (the client above handed its files over on this host): a typed 507 naming the token.
        requests = filler._transport  # the same token, its requests as sent by the client
        requests.request("POST", "/v1/checkpoints/fill/4/sessions", json={"session": "s4", "world_size": 1})
        data = os.urandom(MIB)
        r = httpx.put(f"{srv.url}/v1/checkpoints/fill/4/sessions/s4/files/f.bin", content=data, timeout=60,
                      headers={"Authorization": f"Bearer {FILLER}", "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
        assert r.status_code == 507 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert r.json()["error"]["details"]["token"] == "filler"

        # What it holds is read from the root: a restart forgets nothing ...
        srv.restart()
        with pytest.raises(QuotaExceeded):
            filler.save(make_state(3, mib=0.75), "fill/3").wait(timeout=scaled(60))
        # ... and a checkpoint it deletes stops counting.
        assert filler.remove("fill/1")["removed"] is True
        time.sleep(RECHECK_SECONDS)  # the measure before a refusal is taken at most this often
        saved(filler, make_state(3, mib=0.75), "fill/3")
        saved(saver, good[3], "good/3")
        for n in (2, 3):
            loads(filler, f"fill/{n}", kept[n] if n == 2 else make_state(3, mib=0.75))
        for n, sd in good.items():
            loads(saver, f"good/{n}", sd)
        assert srv.proc is not None and srv.proc.poll() is None
    finally:
        filler.close(wait=False)
        saver.close(wait=False)
        srv.kill()


@pytest.fixture
def small_root(tmp_path):
    """A real 4 MiB tmpfs (needs root, or skips), unmounted afterwards."""
    unmount = small_tmpfs(tmp_path / "small-fs", "4m")
    try:
        yield tmp_path / "small-fs"
    finally:
        unmount()


def test_a_writer_filling_the_root_stops_at_the_reserve_and_a_save_in_progress_commits(small_root, tmp_path):
    root = small_root
    reserve = 512 * KIB
    srv = ServerProcess(root, env={"CKPTD_ROOT_RESERVE": "512KiB", "CKPTD_WRITE_BATCH_BYTES": str(64 * KIB)},
                        log=tmp_path / "server.log").start()
    client = CheckpointClient(srv.url, retry_seconds=600, streams=1, file_bytes=256 * KIB)
    t = Transport(srv.url, retry_seconds=600, timeout=60)
    try:
        first = make_state(1, mib=0.25)
        saved(client, first, "good/1")  # the last good checkpoint

        # Another run's save in progress: its data files have arrived, its index not yet.
        second = make_state(2, mib=0.25)
        base = "/v1/checkpoints/good/2"
        open_session(t, base, "s2", 1, 2)
        index = upload_files(t, base, "s2", build_snapshot(second, 0, 1), compression=None, file_bytes=64 * KIB,
                             streams=1)

        # The filler, hostile: files of 256 KiB into what is left of 4 MiB, then of 4 KiB to take the last
        # pages, never aborting. They are stored until the free space is down to the reserve; then refused (not
        # at a full disk), and again at once.
        requests = client._transport
        requests.request("POST", "/v1/checkpoints/fill/1/sessions", json={"session": "s1", "world_size": 1})
        sent = 0
        for size in (256 * KIB, 4 * KIB):
            data = os.urandom(size)
            headers = {"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}
            while (r := httpx.put(f"{srv.url}/v1/checkpoints/fill/1/sessions/s1/files/f{sent}.bin", content=data,
                                  headers=headers, timeout=60)).status_code == 200:
                sent += 1
                assert sent < 1100, "a 4 MiB filesystem took more than 4 MiB of files"
            assert r.status_code == 507 and r.json()["error"]["code"] == "reserve_reached", r.text
            details = r.json()["error"]["details"]
            assert details["reserve"] == reserve and details["free"] < reserve + size, details
            assert details["file"] == f"f{sent}.bin" and "CKPTD_ROOT_RESERVE" in r.json()["error"]["message"]
        # A new session is refused at the reserve too (its directories and record take blocks); a rank joining
        # the save in progress is not.
        r = httpx.post(f"{srv.url}/v1/checkpoints/fill/9/sessions", json={"session": "s9", "world_size": 1}, timeout=60)
        assert r.status_code == 507 and r.json()["error"]["code"] == "reserve_reached", r.text
        assert not (root / "runs" / "fill" / "9").exists()
        r = httpx.post(f"{srv.url}{base}/sessions", json={"session": "s2", "world_size": 1, "step": 2}, timeout=60)
        assert r.status_code == 200, r.text
        # No write took the disk further than the bytes of the file in progress that were still in the service's
        # write window when they were taken (one upload at a time here).
        assert shutil.disk_usage(root).free >= reserve - 256 * KIB
        # A client's save (its files handed over on this host) raises the typed error, not retried.
        g = torch.Generator().manual_seed(3)
        flood = {"model": {f"t{i}": torch.randn(64 * KIB, generator=g) for i in range(4)}}
        with pytest.raises(ReserveReached) as ei:
            client.save(flood, "fill/2").wait(timeout=scaled(60))
        assert isinstance(ei.value, StorageFull) and ei.value.status == 507 and ei.value.details["reserve"] == reserve

        # The save in progress commits into the reserve (index, manifest, marker, records).
        status = put_index(t, base, "s2", index)
        status = wait_committed(t, base, "good/2", status, time.monotonic() + scaled(60))
        assert status.state == "committed", status
        loads(client, "good/2", second)
        loads(client, "good/1", first)
        loads(client, "good/latest", second)
        assert [c.name for c in client.list_checkpoints("good")] == ["1", "2"]
        assert client.list_checkpoints("fill") == []
        assert srv.proc is not None and srv.proc.poll() is None
    finally:
        t.close()
        client.close(wait=False)
        srv.kill()


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_a_presigned_file_counts_toward_its_writers_quota_until_it_is_stored(moto_s3, tmp_path):
    """On an object store a presigned file's parts are stored as they are PUT, in a multipart upload
    that is no object (not listed) until its confirm; the claim's declared size is what the quota sees
    of it. Before, a measure forgot it: 2 s after a refusal the writer presigned again, without end."""
    import base64
    import hashlib

    from s3_server import aws_env

    tokens = f"filler {FILLER} write:fill* quota=8MiB"
    srv = ServerProcess(moto_s3.url("quota"), env={**aws_env(moto_s3.endpoint), "CKPTD_TOKENS": tokens, "CKPTD_DIRECT_UPLOADS": "true"},
                        log=tmp_path / "server.log").start()
    try:
        http = httpx.Client(base_url=srv.url, timeout=scaled(60), headers={"Authorization": f"Bearer {FILLER}"})
        base, sid = "/v1/checkpoints/fill-s3/1/sessions", "p" * 32
        r = http.post(base, json={"session": sid, "world_size": 1, "direct_uploads": True})
        assert r.status_code == 200 and r.json()["presigned"] is True, r.text
        data = os.urandom(6 * MIB)  # two parts, never confirmed: 6 MiB of the quota's 8 MiB
        parts = [data[:5 * MIB], data[5 * MIB:]]
        claim = {"size": len(data), "part_size": 5 * MIB,
                 "sha256": [base64.b64encode(hashlib.sha256(p).digest()).decode() for p in parts]}
        signed = http.post(f"{base}/{sid}/files/r0.bin/presign", json=claim)
        assert signed.status_code == 200 and signed.json()["upload_id"], signed.text
        for url, headers, part in zip(signed.json()["urls"], signed.json()["headers"], parts):
            assert httpx.put(url, content=part, headers=headers, timeout=scaled(60)).status_code == 200
        time.sleep(RECHECK_SECONDS + 0.2)  # measured again before the refusal: the parts stored are still held
        r = http.post(f"{base}/{sid}/files/r1.bin/presign", json=claim)
        assert r.status_code == 507 and r.json()["error"]["code"] == "quota_exceeded", r.text
    finally:
        srv.stop()


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_a_checkpoint_removed_and_saved_again_under_its_session_counts_at_its_new_size(tmp_path):
    """A committed session's bytes are measured once per process and remembered by its checkpoint and
    session; the writer names both. Before, a checkpoint measured small, removed (``DELETE``, a trainer's
    own right) and saved again under the same name and session id kept its first size in the quota's
    measure for the life of the process: 1.5 MiB counted as 60 KiB, and then the next write past the quota
    was taken."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS": TOKENS}, log=tmp_path / "server.log").start()
    t = Transport(srv.url, retry_seconds=600, timeout=60, token=FILLER)
    http = httpx.Client(base_url=srv.url, timeout=scaled(60), headers={"Authorization": f"Bearer {FILLER}"})

    def save(name: str, sid: str, mib: float) -> None:
        base = f"/v1/checkpoints/fill/{name}"
        open_session(t, base, sid, 1, int(name))
        index = upload_files(t, base, sid, build_snapshot(make_state(int(name), mib=mib), 0, 1), compression=None,
                             file_bytes=256 * KIB, streams=1)
        status = wait_committed(t, base, f"fill/{name}", put_index(t, base, sid, index), time.monotonic() + scaled(60))
        assert status.state == "committed", status

    def put(name: str, size: int) -> httpx.Response:
        data = os.urandom(size)
        http.post(f"/v1/checkpoints/fill/{name}/sessions", json={"session": "u", "world_size": 1})
        return http.put(f"/v1/checkpoints/fill/{name}/sessions/u/files/f.bin", content=data,
                        headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})

    try:
        save("1", "s", 0.06)
        save("2", "t", 0.06)
        time.sleep(RECHECK_SECONDS + 0.2)
        assert put("8", 3 * MIB).status_code == 507  # measured before the refusal: fill/1 is known, small
        r = http.delete("/v1/checkpoints/fill/1")
        assert r.status_code == 200, r.text
        save("1", "s", 1.5)  # the same name and session, 1.5 MiB
        time.sleep(RECHECK_SECONDS + 0.2)
        r = put("9", MIB)  # measured again before a refusal: 1.6 MiB held, 1 MiB more is past 2 MiB
        assert r.status_code == 507 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert r.json()["error"]["details"]["held"] >= 3 * MIB // 2, r.text
    finally:
        http.close()
        srv.stop()


def test_a_writer_whose_measure_hangs_holds_one_thread_and_another_token_saves(tmp_path):
    """A measure of what a writer holds walks its runs on the root: 20,000 open sessions take 5 s. Before,
    it ran under the writer's lock in a request thread, and the writer's other uploads queued on that lock,
    each holding one of the service's 40 request threads: a writer past its quota keeping 64 uploads going
    stalled every other token's opens, uploads and indexes. Here the measure is made to hang (a staging
    session's presign claim that is a FIFO nobody writes: a root that never answers), the strongest form of
    slow: the writer's uploads are still refused at once, from its last measure, and the other token's save
    commits."""
    root = tmp_path / "root"
    tokens = f"filler {FILLER} write:fill* quota=256KiB; saver {SAVER} write:good*"
    srv = ServerProcess(root, env={"CKPTD_TOKENS": tokens}, log=tmp_path / "server.log").start()
    saver = CheckpointClient(srv.url, token=SAVER, retry_seconds=600)
    http = httpx.Client(base_url=srv.url, timeout=scaled(120), headers={"Authorization": f"Bearer {FILLER}"})
    base = "/v1/checkpoints/fill/1/sessions"
    stop = threading.Event()
    codes: list[int] = []

    def put(file: str, size: int) -> int:
        data = os.urandom(size)
        try:
            return http.put(f"{base}/s1/files/{file}", content=data,
                            headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}).status_code
        except httpx.HTTPError:
            return 0  # no answer (the service kept it waiting)

    def flood(n: int) -> None:
        i = 0
        while not stop.is_set():
            codes.append(put(f"flood-{n}-{i}.bin", 100 * KIB))
            i += 1

    fifo = root / "runs" / "fill" / "0" / "sessions" / "s0" / "presigned" / "x.bin"
    flooders = [threading.Thread(target=flood, args=(n,), daemon=True) for n in range(64)]
    try:
        assert http.post(base, json={"session": "s1", "world_size": 1}).status_code == 200
        assert put("first.bin", 200 * KIB) == 200  # measured (nothing yet), then counted: 200 KiB of 256
        fifo.parent.mkdir(parents=True)
        os.mkfifo(fifo)  # from now on a measure of the filler's runs never ends
        time.sleep(RECHECK_SECONDS + 0.2)  # the next refusal measures again
        for f in flooders:
            f.start()
        sd = make_state(7, mib=0.25)
        assert saver.save(sd, "good/1").wait(timeout=scaled(60)).state == "committed"
        loads(saver, "good/1", sd)
        assert 507 in codes and 200 not in codes, codes[:20]  # refused at once, from the last measure
    finally:
        stop.set()
        for _ in range(8):  # let any measure blocked on the FIFO end (it reads an empty claim)
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                break
        for f in flooders:
            if f.ident is not None:
                f.join(scaled(60))
        http.close()
        saver.close(wait=False)
        srv.kill()


def test_session_opens_are_charged_to_the_quota(tmp_path):
    """Before, an open (a checkpoint's directories and session record: 16 KiB of a 4 KiB-block disk) was
    charged nothing: 500 opens took 8 MiB on disk while the quota counted none of it, so a writer with a
    quota filled the disk by opening checkpoints. Each new session is charged a fixed cost now (joining one
    is not), and refused past the quota."""
    tokens = f"filler {FILLER} write:fill* quota=256KiB"
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS": tokens}, log=tmp_path / "server.log").start()
    http = httpx.Client(base_url=srv.url, timeout=scaled(60), headers={"Authorization": f"Bearer {FILLER}"})
    try:
        codes = [http.post(f"/v1/checkpoints/fill/{n}/sessions", json={"session": "s", "world_size": 1})
                 for n in range(40)]
        refused = [r for r in codes if r.status_code != 200]
        assert refused, "40 opens of 16 KiB each were taken within a 256 KiB quota"
        assert refused[0].status_code == 507 and refused[0].json()["error"]["code"] == "quota_exceeded", refused[0].text
        first = codes.index(refused[0])
        assert 8 <= first <= 16 and all(r.status_code == 507 for r in codes[first:]), [r.status_code for r in codes]
        r = http.post("/v1/checkpoints/fill/0/sessions", json={"session": "s", "world_size": 1})
        assert r.status_code == 200, r.text  # a rank joining a session already open is not charged again
    finally:
        http.close()
        srv.stop()
