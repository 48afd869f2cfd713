"""ckptd: distributed checkpoint and reshard service for sharded PyTorch training.

Packages: ``ckptd.storage`` (one small storage interface, local and fsspec),
``ckptd.store`` (the checkpoint store core: sessions, commit, read, verify;
used by the service and by the CLI without HTTP), ``ckptd.service`` (the
FastAPI app), ``ckptd.cli`` (the ``ckptd`` command).
"""

__version__ = "0.1.0"
