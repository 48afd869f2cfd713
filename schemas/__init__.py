"""ckptd_schemas: the manifest, API bodies, errors and pure geometry shared by
the ckptd service and the ``ckptd_client`` trainer client. No I/O here."""

from .api import (
    AdoptFile, CheckpointSummary, LinkFile, DirectWrites, OpenSession, RankIndex, RunSummary, SessionInfo, SessionStatus,
    TensorColumns, UploadResult,
)
from .chunktable import ChunkColumns
from .dtypes import ITEMSIZE, DType, itemsize
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .geometry import Box, Region, check_tiling, flat_range_to_boxes, intersect_regions, row_major_strides
from .manifest import (
    FORMAT_VERSION, AdoptedFile, BoxChunk, Chunk, FileEntry, FlatChunk, Location, Manifest, ObjectEntry, ParamGroup,
    RankInfo, TensorEntry, Topology,
)
from .names import (LATEST, CheckpointRef, check_file, check_name, check_run, check_session, check_staged, linked_name,
                    parse_ref, staged_name)
from .readplan import Copy, Fetch, PlanBudget, ReadPlan, ReadRequest, dest_region, plan_reads, verify_fetch

__all__ = [
    *_errors_all,
    "FORMAT_VERSION", "ITEMSIZE", "LATEST",
    "AdoptFile", "AdoptedFile", "Box", "BoxChunk", "CheckpointRef", "CheckpointSummary", "Chunk", "ChunkColumns", "Copy", "DirectWrites", "DType", "Fetch", "FileEntry", "LinkFile",
    "FlatChunk", "Location", "Manifest", "ObjectEntry", "OpenSession", "ParamGroup", "RankIndex", "RankInfo",
    "PlanBudget", "ReadPlan", "ReadRequest", "Region", "RunSummary", "SessionInfo", "SessionStatus", "TensorColumns", "TensorEntry",
    "Topology", "UploadResult",
    "check_file", "check_name", "check_run", "check_session", "check_staged", "check_tiling", "dest_region",
    "flat_range_to_boxes", "intersect_regions", "itemsize", "parse_ref", "plan_reads", "row_major_strides",
    "linked_name", "staged_name", "verify_fetch",
]
