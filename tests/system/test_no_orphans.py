"""An interrupted test run leaves no ``ckptd serve`` behind: a server started by the test support
dies with the process that started it, even when that process is SIGKILLed (no finalizer runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from support import REPO, scaled


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited; only its parent's reaping is left


def test_a_killed_test_process_takes_its_server_with_it(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from support import ServerProcess
        srv = ServerProcess({str(tmp_path / "root")!r}).start()
        print(srv.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + scaled(30)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"ckptd serve (pid {pid}) outlived the process that started it")
