"""ckptd_client: the trainer-side client of the ckptd checkpoint service.

Imports without the server's dependencies (FastAPI, uvicorn, s3fs)::

    from ckptd_client import CheckpointClient, FlatShard
    client = CheckpointClient("http://127.0.0.1:8470")
    client.save(state_dict, "gpt/1000").wait()
    client.load(state_dict, "gpt/latest")

The public names below are resolved on first use (PEP 562): a tool that
imports one module of the package then skips importing
``torch.distributed.tensor``, about half a second of start-up, and those that
only list, read and verify (``CatalogClient``) skip torch entirely.
"""

from typing import TYPE_CHECKING

from ckptd_schemas.errors import *  # noqa: F403
from ckptd_schemas.errors import __all__ as _errors
from ckptd_schemas.lazy import lazy_exports

if TYPE_CHECKING:
    from ._load import LoadReport
    from ._save import SaveHandle
    from .catalog import CatalogClient
    from .client import CheckpointClient
    from .flat import FlatShard
    from .preempt import PreemptionGuard
    from ._dist import solo
    from .zero import flat_partition

_LAZY = {"CatalogClient": ".catalog", "CheckpointClient": ".client", "FlatShard": ".flat",
         "LoadReport": "._load", "PreemptionGuard": ".preempt", "SaveHandle": "._save", "flat_partition": ".zero",
         "solo": "._dist"}

__all__ = ["CatalogClient", "CheckpointClient", "FlatShard", "LoadReport", "PreemptionGuard", "SaveHandle",
           "flat_partition", "solo", *_errors]

__getattr__ = lazy_exports(__name__, _LAZY, globals())
