"""torchtitan's checkpoint manager saving and loading through ckptd: ``folder="ckptd://RUN"``.

Use (a torchtitan config function; details and what runs where in docs/integrations-torchtitan.md)::

    from ckptd_client.integrations.torchtitan import CkptdCheckpointManager
    config.checkpoint = CkptdCheckpointManager.Config(enable=True, folder="ckptd://llama3", interval=500,
                                                      keep_latest_k=3, async_mode="async")

Why this shape (torchtitan 0.3.0, ``torchtitan/components/checkpointer/dcp.py``): its
``CheckpointManager`` does every storage step but two through ``torchtitan.tools.filesystem``, which
hands any ``scheme://`` path to fsspec, and makes its DCP calls in two public methods,
``dcp_save`` and ``dcp_load``, with ``checkpoint_id`` only (no writer or reader to pass in). So:

1. :class:`CkptdFileSystem` (fsspec protocol ``ckptd``, registered on import) answers the manager's
   filesystem calls from the service's catalog: the folder ``ckptd://RUN`` is the run, its entry
   ``step-N`` is the committed checkpoint ``RUN/N`` (a numeric name is ckptd's step, so
   ``RUN/latest``, ``ckptd gc`` and the service's retention policy see it), ``step-N/.metadata``
   exists once it committed (``_find_load_step`` looks for it), and ``rm`` (the purge thread of
   ``keep_latest_k``) is ``CatalogClient.remove``: retention's rules decide, so the newest and the
   newest verified checkpoint are never removed.
2. ``CkptdCheckpointManager`` (built on first access, so this module imports without torchtitan)
   overrides ``dcp_save`` / ``dcp_load`` to call :func:`dcp_save` / :func:`dcp_load`: the same
   ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls with the same process group, checkpointer
   type and stager, plus ``storage_writer=client.dcp_writer(ref)`` / ``storage_reader=client.dcp_reader(ref)``.

Call order (the manager's own): ``load()``: ``exists(folder)`` -> ``ls(folder)`` + ``isfile(step-N/.metadata)``
-> ``isdir(step-N)`` -> ``dcp_load``; ``save(step)``: ``dcp_save`` (async: returns once staged) ->
``_purge_stale_checkpoints``: ``isdir(folder)``, ``ls(folder)``, ``rm(step-K)`` on a thread. A save in
flight is not listed until it commits, so it never counts towards ``keep_latest_k``.
The service is ``$CKPTD_URL`` (token ``$CKPTD_TOKEN``), as for ``CheckpointClient()``.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.spec import AbstractFileSystem

from ckptd_schemas import CheckpointBeingDeleted, CheckpointLeased, InvalidName, NotFound, check_run

from ..catalog import CatalogClient

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.staging import AsyncStager

    from ..client import CheckpointClient

__all__ = ["PROTOCOL", "CkptdCheckpointManager", "CkptdFileSystem", "checkpoint_id", "dcp_load", "dcp_save",
           "ref_of"]

PROTOCOL = "ckptd"
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")  # torchtitan's AsyncMode values
_STEP = re.compile(r"step-(0|[1-9][0-9]*)")
log = logging.getLogger(__name__)
CkptdCheckpointManager: type  # torchtitan's CheckpointManager subclass, built on first access (``__getattr__``)


def _split(path: str) -> list[str]:
    p = str(path)
    if p.startswith(f"{PROTOCOL}://"):
        p = p[len(PROTOCOL) + 3:]
    return [part for part in p.strip("/").split("/") if part]


def checkpoint_id(run: str, step: int) -> str:
    """torchtitan's id of ``step`` in folder ``ckptd://RUN``: ``ckptd://RUN/step-N``."""
    return f"{PROTOCOL}://{check_run(run)}/step-{int(step)}"


def ref_of(checkpoint_id: str) -> str:
    """The ckptd checkpoint behind a torchtitan id: ``ckptd://RUN/step-N`` -> ``RUN/N``."""
    parts = _split(checkpoint_id)
    m = _STEP.fullmatch(parts[1]) if len(parts) == 2 else None
    if not str(checkpoint_id).startswith(f"{PROTOCOL}://") or m is None:
        raise InvalidName(f"not a ckptd torchtitan checkpoint id: {checkpoint_id!r} (expected "
                          f"'{PROTOCOL}://RUN/step-N')", value=str(checkpoint_id)[:200])
    return f"{check_run(parts[0])}/{m.group(1)}"


# -- the DCP calls: torchtitan's CheckpointManager.dcp_save / dcp_load, with ckptd's writer and reader --

def dcp_save(client: CheckpointClient, state_dict: dict[str, Any], checkpoint_id: str, *,
             async_mode: str = "disabled", process_group: ProcessGroup | None = None,
             stager: AsyncStager | None = None) -> Future | Any | None:
    """torchtitan's save dispatch: ``disabled`` -> ``dcp.save`` (None); ``async`` -> ``dcp.async_save``
    on ``process_group`` (a Future); ``async_with_pinned_mem`` -> ``dcp.async_save`` in a process with
    ``stager`` (an ``AsyncSaveResponse``: staging and upload futures)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if async_mode not in ASYNC_MODES:
        raise ValueError(f"async_mode must be one of {ASYNC_MODES}, not {async_mode!r}")
    writer = client.dcp_writer(ref_of(checkpoint_id))
    if async_mode == "async":
        return dcp.async_save(state_dict, storage_writer=writer, process_group=process_group)
    if async_mode == "async_with_pinned_mem":
        return dcp.async_save(state_dict, storage_writer=writer, process_group=process_group,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
    return dcp.save(state_dict, storage_writer=writer)


def dcp_load(client: CheckpointClient, state_dict: dict[str, Any], checkpoint_id: str) -> None:
    """torchtitan's native-format load: ``dcp.load`` in place, at any world size."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=client.dcp_reader(ref_of(checkpoint_id)))


# -- the folder: fsspec over the service's catalog ------------------------------------------------------

_catalogs: dict[tuple[str | None, str | None], CatalogClient] = {}
_catalogs_lock = threading.Lock()


def _catalog(url: str | None, token: str | None) -> CatalogClient:
    with _catalogs_lock:
        if (url, token) not in _catalogs:
            _catalogs[(url, token)] = CatalogClient(url, token=token)
        return _catalogs[(url, token)]


class CkptdFileSystem(AbstractFileSystem):
    """``ckptd://RUN[/step-N[/.metadata]]``, read-only but for ``rm`` of a checkpoint. Only committed
    trainer checkpoints with a plain numeric name are listed (not resharded copies, not saves in
    flight). A service that cannot be reached raises: it never reads as an empty folder."""

    protocol = PROTOCOL
    root_marker = ""
    cachable = False  # the clients are shared instead (``_catalog``), keyed by url and token

    def __init__(self, url: str | None = None, token: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.catalog = _catalog(url, token)

    def _steps(self, run: str) -> list[int]:
        """The run's committed trainer steps; a run without a visible checkpoint is not there."""
        try:
            listed = self.catalog.list_checkpoints(check_run(run))
        except NotFound as e:
            raise FileNotFoundError(f"{PROTOCOL}://{run}: {e.message}") from e
        if not listed:
            raise FileNotFoundError(f"{PROTOCOL}://{run}: no visible checkpoint")
        return sorted(int(c.name) for c in listed
                      if c.derived_from is None and c.name.isdigit() and str(int(c.name)) == c.name)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        parts = _split(path)
        name = "/".join(parts)
        if not parts:
            return {"name": "", "type": "directory", "size": 0}
        steps = self._steps(parts[0])
        if len(parts) == 1:
            return {"name": name, "type": "directory", "size": 0}
        m = _STEP.fullmatch(parts[1])
        if m is not None and int(m.group(1)) in steps:
            if len(parts) == 2:
                return {"name": name, "type": "directory", "size": 0}
            if parts[2:] == [".metadata"]:
                return {"name": name, "type": "file", "size": 0}
        raise FileNotFoundError(f"{PROTOCOL}://{name}")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        parts = _split(path)
        if not parts:
            out = [{"name": r.run, "type": "directory", "size": 0} for r in self.catalog.list_runs()]
        elif len(parts) == 1:
            out = [{"name": f"{parts[0]}/step-{s}", "type": "directory", "size": 0} for s in self._steps(parts[0])]
        else:
            entry = self.info(path)
            out = [self.info(f"{entry['name']}/.metadata")] if entry["type"] == "directory" else [entry]
        return out if detail else [e["name"] for e in out]

    def _exists_as(self, path: str, kind: str | None) -> bool:
        try:
            entry = self.info(path)
        except FileNotFoundError:
            return False
        return kind is None or entry["type"] == kind

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._exists_as(path, None)

    def isdir(self, path: str) -> bool:
        return self._exists_as(path, "directory")

    def isfile(self, path: str) -> bool:
        return self._exists_as(path, "file")

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> None:
        """Remove checkpoints (``ckptd://RUN/step-N``) through the service's retention rules; one that
        retention keeps (the newest, the newest verified, a leased one) stays and is logged."""
        for p in [path] if isinstance(path, str) else path:
            ref = ref_of(f"{PROTOCOL}://{'/'.join(_split(p))}")
            try:
                answer = self.catalog.remove(ref)
            except NotFound as e:
                raise FileNotFoundError(f"{PROTOCOL}://{ref}: {e.message}") from e
            except (CheckpointLeased, CheckpointBeingDeleted) as e:  # a reader holds it, or it is being deleted
                answer = {"removed": False, "reason": e.message}
            if not answer.get("removed"):
                log.info("ckptd keeps %s: %s", ref, answer.get("reason"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raise NotImplementedError(f"{PROTOCOL}:// holds checkpoints, not files: save and load them through "
                                  f"CkptdCheckpointManager (dcp_save / dcp_load)")


fsspec.register_implementation(PROTOCOL, CkptdFileSystem, clobber=True)


# -- the manager: torchtitan's, with its two DCP calls through ckptd (built on first access) ----------

def _manager_class() -> type:
    from dataclasses import dataclass

    from torchtitan.components.checkpoint import MODEL, CheckpointManager
    from torchtitan.tools.utils import GarbageCollection

    from ..client import CheckpointClient

    class CkptdCheckpointManager(CheckpointManager):
        """torchtitan's ``CheckpointManager`` with ``folder="ckptd://RUN"`` on a ckptd service. An
        ``initial_load_path`` (a directory, or HF safetensors) still loads through torchtitan's own code."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

        def __init__(self, config: Any, **kwargs: Any) -> None:
            self._client: CheckpointClient | None = None
            if config.enable:  # before torchtitan starts its purge thread and process group
                parts = _split(config.folder)
                if not config.folder.startswith(f"{PROTOCOL}://") or len(parts) != 1:
                    raise ValueError(f"checkpoint.folder must be '{PROTOCOL}://RUN' for CkptdCheckpointManager, "
                                     f"not {config.folder!r}")
                check_run(parts[0])
            super().__init__(config, **kwargs)

        @property
        def ckptd(self) -> CheckpointClient:
            if self._client is None:
                self._client = CheckpointClient()
            return self._client

        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
            if to_hf:  # torchtitan refuses last_save_in_hf with a remote folder before this
                raise ValueError("HF safetensors are exported from ckptd: `ckptd export RUN/N --format safetensors`")
            mode = str(getattr(async_mode, "value", async_mode))  # torchtitan's AsyncMode
            ret = dcp_save(self.ckptd, state_dict, checkpoint_id, async_mode=mode, process_group=self.pg,
                           stager=self.stager)
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return ret

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            if from_hf or not str(checkpoint_id).startswith(f"{PROTOCOL}://"):
                return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            dcp_load(self.ckptd, state_dict, checkpoint_id)
            if MODEL in self.states:  # as torchtitan does: model keys are flattened into the state dict
                self.states[MODEL].load_state_dict(state_dict)

        def _close(self) -> None:
            super()._close()
            client, self._client = getattr(self, "_client", None), None
            if client is not None:
                client.close()

    return CkptdCheckpointManager


def __getattr__(name: str) -> Any:
    if name == "CkptdCheckpointManager":
        cls = _manager_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
