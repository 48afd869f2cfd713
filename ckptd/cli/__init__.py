"""The ``ckptd`` command line."""
