"""``ckptd gc --dry-run`` only reads, and says which checkpoint every deletion would rely on.

Three checkpoints saved through a real ``ckptd serve``; the service stopped; their commit records
removed so that rule 5 (the newest checkpoint that verifies) must be established by reading the
bytes. A dry run, offline (``--root``) and through a service (``--server``), leaves every file of
the root as it was (names, sizes, bytes) and names the newest verified checkpoint and how that was
established; with the newest checkpoint damaged, it names it as not verifying, keeps it out of
``--keep-last`` as a real run would, and still writes no record.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from ckptd_client import CheckpointClient
from support import ServerProcess, make_state, verified

RUN = "dry"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=180)


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _root_with_three(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    srv = ServerProcess(root, env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    try:
        with CheckpointClient(srv.url, incremental=False) as c:
            for step in (1, 2, 3):
                c.save(make_state(step), f"{RUN}/{step}").wait()
        verified(srv.url, *(f"{RUN}/{step}" for step in (1, 2, 3)))  # no re-read writes once they are removed
    finally:
        srv.stop()
    for rec in (root / "runs" / RUN).glob("*/VERIFIED.json"):
        rec.unlink()  # rule 5 must now read the bytes
    return root


def test_a_dry_run_verifies_without_writing_and_names_the_newest_verified(tmp_path):
    root = _root_with_three(tmp_path)
    before = _tree(root)
    out = _cli("gc", RUN, "--keep-last", "1", "--dry-run", "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert f"would delete {RUN}/1" in out.stdout and f"would delete {RUN}/2" in out.stdout, out.stdout
    assert f"newest verified {RUN}/3 (verified now, not recorded (dry run))" in out.stdout, out.stdout
    assert _tree(root) == before  # not a record, not a lease, not a byte

    srv = ServerProcess(root, env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    try:
        before = _tree(root)
        out = _cli("gc", RUN, "--keep-last", "1", "--dry-run", "--server", srv.url)
        assert out.returncode == 0, out.stderr
        assert f"newest verified {RUN}/3 (verified now, not recorded (dry run))" in out.stdout, out.stdout
        assert {k: v for k, v in _tree(root).items() if not k.startswith("gc/")} == before
    finally:
        srv.stop()


def test_a_dry_run_that_finds_the_newest_bad_says_so_and_still_writes_nothing(tmp_path):
    root = _root_with_three(tmp_path)
    data = sorted((root / "runs" / RUN / "3" / "sessions").glob("*/files/*"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    before = _tree(root)
    out = _cli("gc", RUN, "--keep-last", "1", "--dry-run", "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert f"does not verify {RUN}/3" in out.stdout, out.stdout
    assert f"newest verified {RUN}/2" in out.stdout, out.stdout
    # step 3 is bad: --keep-last 1 keeps step 2 (a real run would record step 3 as known bad)
    assert f"would delete {RUN}/1" in out.stdout and f"would delete {RUN}/2" not in out.stdout, out.stdout
    assert _tree(root) == before
    assert not (root / "runs" / RUN / "3" / "VERIFIED.json").exists()
