"""Interoperability with PyTorch's formats: import DCP directories, export safetensors and torch.save files.

* :mod:`ckptd.interop.dcp_import` - ``ckptd import dcp DIR REF``: a directory written by
  ``torch.distributed.checkpoint.FileSystemWriter`` becomes a committed ckptd checkpoint.
* :mod:`ckptd.interop.export` - ``ckptd export REF --format safetensors|torch OUT``.

Both stream one item (DCP) or one slab of one tensor (export) at a time: memory stays bounded
whatever the checkpoint's size.
"""
