"""ckptd_client: the trainer-side client of the ckptd checkpoint service.

Imports without the server's dependencies (FastAPI, uvicorn, s3fs)::

    from ckptd_client import CheckpointClient, FlatShard
    client = CheckpointClient("http://127.0.0.1:8470")
    client.save(state_dict, "gpt/1000").wait()
    client.load(state_dict, "gpt/latest")
"""

from ckptd_schemas.errors import *  # noqa: F403
from ckptd_schemas.errors import __all__ as _errors

from ._load import LoadReport
from ._save import SaveHandle
from .client import CheckpointClient
from .flat import FlatShard
from .zero import flat_partition

__all__ = ["CheckpointClient", "FlatShard", "LoadReport", "SaveHandle", "flat_partition", *_errors]
