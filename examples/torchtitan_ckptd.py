"""torchtitan's llama3 debug model, checkpointing through ckptd: a torchtitan config module.

On accelerator hosts, with ``ckptd serve`` running (``$CKPTD_URL``, default http://127.0.0.1:8470)::

    PYTHONPATH=. torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module examples.torchtitan_ckptd --config llama3_debugmodel_ckptd

Kill the job and start it again (any world size, ``exclude_from_loading=["dataloader"]`` when the
data-parallel degree changes: torchtitan's data loader does not reshard): it resumes from the
newest committed ``ckptd://llama3-debug/step-N``, which is ckptd's ``llama3-debug/N``.
torchtitan's trainer does not run on a CPU-only host (docs/integrations-torchtitan.md says where it
stops); tests/integrations/test_torchtitan.py runs this file's settings through the same DCP calls.
"""

# [ckptd-torchtitan:begin]
from ckptd_client.integrations.torchtitan import CkptdCheckpointManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def llama3_debugmodel_ckptd():
    config = llama3_debugmodel()
    config.checkpoint = CkptdCheckpointManager.Config(
        enable=True, folder="ckptd://llama3-debug", interval=2, keep_latest_k=2,
        async_mode="async", last_save_model_only=False)
    return config
# [ckptd-torchtitan:end]
