"""ckptd_schemas: what the ckptd service and the ``ckptd_client`` trainer client share: the manifest,
the API bodies, the typed errors, pure geometry and the read plan; and, in :mod:`ckptd_schemas.format`,
the checkpoint's byte format: the codecs (zstandard, blosc2), the commit's frame checks, the torch copy
kernel and the safe decoding of stored objects (torch).

No network and no storage here: nothing opens a connection or knows where checkpoints are stored.
The format reads only what its caller hands it: bytes, buffers, tensors, an open file, or a path
(``format.objects.load_torch`` opens the one it is given); ``python -m ckptd_schemas.jsonschema``
writes the manifest's JSON Schema. Importing this package imports neither torch nor the format:
import a format module by its name (see :mod:`ckptd_schemas.format`)."""

from typing import TYPE_CHECKING

from .chunktable import ChunkColumns
from .dtypes import ITEMSIZE, DType, itemsize
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .lazy import lazy_exports
from .geometry import Box, Region, check_tiling, flat_range_to_boxes, intersect_regions, row_major_strides
from .manifest import (
    FORMAT_VERSION, BoxChunk, Chunk, FileEntry, FlatChunk, Location, Manifest, ObjectEntry, ParamGroup,
    RankInfo, TensorEntry, Topology,
)
from .names import (LATEST, CheckpointRef, check_file, check_name, check_new_name, check_run, check_session,
                    linked_name, parse_ref)

if TYPE_CHECKING:
    from .api import (
        CheckpointSummary, ConfirmUpload, LinkFile, OpenSession, PresignedUpload,
        PresignUpload, RankIndex, RunSummary, SessionInfo, SessionStatus, TensorColumns, UploadResult,
    )
    from .readplan import (
        Copy, Fetch, PlanBudget, ReadPlan, ReadRequest, dest_region, plan_reads, run_fetches, verify_fetch,
    )

# The HTTP bodies and the read plan are imported when first named: a process that only reads a
# manifest (``ckptd verify``, ``ckptd show``) does not build their models (a tenth of its start-up).
_LAZY = {
    **dict.fromkeys(("CheckpointSummary", "ConfirmUpload", "LinkFile", "OpenSession",
                     "PresignUpload", "PresignedUpload", "RankIndex", "RunSummary", "SessionInfo", "SessionStatus",
                     "TensorColumns", "UploadResult"), ".api"),
    **dict.fromkeys(("Copy", "Fetch", "PlanBudget", "ReadPlan", "ReadRequest", "dest_region", "plan_reads",
                     "run_fetches", "verify_fetch"), ".readplan"),
}
__getattr__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    *_errors_all, *_LAZY,
    "Box", "BoxChunk", "CheckpointRef", "Chunk", "ChunkColumns", "DType", "FORMAT_VERSION", "FileEntry",
    "FlatChunk", "ITEMSIZE", "LATEST", "Location", "Manifest", "ObjectEntry", "ParamGroup", "RankInfo", "Region",
    "TensorEntry", "Topology", "check_file", "check_name", "check_new_name", "check_run", "check_session",
    "check_tiling", "flat_range_to_boxes", "intersect_regions", "itemsize", "linked_name", "parse_ref",
    "row_major_strides",
]
