"""Reserved object names: ckptd's own records inside a checkpoint (no torch import, for tools)."""

RESERVED = "__ckptd."  # prefix of every name below; never a state-dict key of the user's
DCP_METADATA = RESERVED + "dcp_metadata"  # DCP's own Metadata, torch.save'd (CkptdStorageWriter)
