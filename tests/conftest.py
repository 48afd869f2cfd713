from __future__ import annotations

import pytest

from support import ServerProcess


@pytest.fixture
def server(tmp_path):
    """A real ``ckptd serve`` on 127.0.0.1 over a fresh local root."""
    srv = ServerProcess(tmp_path / "root").start()
    yield srv
    srv.stop()
