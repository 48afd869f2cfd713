"""The checkpoint's byte format, as both sides read and write it: the one place the client and the
service share code about stored bytes.

* :mod:`.encoding` - how a chunk's bytes are stored: the codecs (``"zstd"``, ``"blosc2"``), encode,
  bounded decode, frame sizes, and a copy's source bytes out of a verified fetch (``source_bytes``).
  Whether a chunk is compressed at all is the client's policy (``ckptd_client.codec``), not this;
* :mod:`.frames` - a compressed chunk checked as its bytes pass, in bounded memory (the commit's
  codec check);
* :mod:`.assemble` - the torch copy kernel: a copy's regions out of a verified fetch into a
  destination tensor (``CheckpointClient.load``, the DCP reader, the service's torch engine);
* :mod:`.engines` - the copy engines the service assembles tensor bytes with (reshard, drills,
  digests, export): numpy on the host, torch on a device, over :mod:`.assemble`;
* :mod:`.objects` - non-tensor objects: how they are stored, and how they are read back without
  running code.

Nothing is imported here: :mod:`.assemble` and :mod:`.objects` import torch, which a process that
only checks frames (``ckptd verify``, the commit) or reads a manifest does not pay for. Import the
module that holds the name (``from ckptd_schemas.format.encoding import decode_frame``).
"""
