"""Non-tensor objects of a state dict: how they are stored, and how they are read back without running code.

The rules live with the byte format, in :mod:`ckptd_schemas.format.objects` (the service's
``ckptd export`` and ``ckptd import dcp`` read objects with the same code); this module re-exports
its public names for trainer code: :class:`ObjectPolicy`, :class:`TrustedObjectWarning`,
:func:`default_safe_globals`, :func:`decode_object`, :func:`encode_object`, ...
"""

from ckptd_schemas.format.objects import (
    SAFE, Encoded, ObjectPolicy, SafeGlobal, TrustedObjectWarning, UnsafeData, check_payload, decode_object,
    default_safe_globals, encode_object, json_exact, load_dcp_file_metadata, load_dcp_metadata, load_torch,
    reencode_for_dcp,
)

__all__ = [
    "Encoded", "ObjectPolicy", "SAFE", "SafeGlobal", "TrustedObjectWarning", "UnsafeData", "check_payload",
    "decode_object", "default_safe_globals", "encode_object", "json_exact", "load_dcp_file_metadata",
    "load_dcp_metadata", "load_torch", "reencode_for_dcp",
]
