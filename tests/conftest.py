from __future__ import annotations

import pytest

from support import ServerProcess


@pytest.fixture
def server(tmp_path):
    """A real ``ckptd serve`` on 127.0.0.1 over a fresh local root."""
    srv = ServerProcess(tmp_path / "root").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    """A real S3 protocol server on loopback for the whole session: ``python -m moto.server``.

    moto comes with the ``dev`` extra (``moto[server]``); s3fs with ``s3``.
    """
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    from s3_server import MotoServer

    srv = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    yield srv
    srv.stop()


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    """This process's environment pointed at the moto server (standard AWS variables only)."""
    from s3_server import AWS_VARS_TO_CLEAR

    for k in AWS_VARS_TO_CLEAR:
        monkeypatch.delenv(k, raising=False)
    for k, v in moto_s3.env.items():
        monkeypatch.setenv(k, v)
    return moto_s3.env
