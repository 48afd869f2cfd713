"""Trainer integrations of the ckptd client, one module per library, each imported only when used.

- ``ckptd_client.integrations.lightning``: ``CkptdCheckpointIO``, a PyTorch Lightning ``CheckpointIO``
  plugin (``Trainer(plugins=[CkptdCheckpointIO("run")])``).
- ``ckptd_client.integrations.accelerate``: ``save_state`` / ``load_state`` for a Hugging Face
  ``Accelerator`` (model, optimizer, scheduler, scaler, registered objects, RNG states, step).

Other modules here (torchtitan) are described in their own docstrings and docs pages.

Nothing here imports Lightning or Accelerate: ``import ckptd_client`` stays as light as before, and
each module needs only its own library (the ``integrations`` extra installs both). The how and why of
each is in docs/integrations.md.
"""
