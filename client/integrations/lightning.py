"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves, loads and removes checkpoints through ckptd.

    from ckptd_client.integrations.lightning import CkptdCheckpointIO
    trainer = Trainer(strategy="ddp", plugins=[CkptdCheckpointIO("demo")], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model)                                      # ModelCheckpoint saves demo/epoch0-step2, ...
    trainer.fit(model, ckpt_path="ckptd://demo/latest")    # a later job, at any world size

Call order, as Lightning makes it: ``save_checkpoint`` (rank 0 only, under DDP and single-device
strategies: the checkpoint dict is full there), ``remove_checkpoint`` (rank 0, ``ModelCheckpoint``
dropping one past ``save_top_k``), ``load_checkpoint`` (every rank, ``fit(ckpt_path=...)``), ``teardown``.

Paths become refs ``RUN/NAME``: ``RUN`` is the plugin's, ``NAME`` the file name without ``.ckpt``,
``=`` dropped and other characters outside ckptd's names turned into ``_``
(``dirpath/epoch=0-step=10.ckpt`` is ``RUN/epoch0-step10``); the step is Lightning's ``global_step``.
A path ``ckptd://RUN/NAME`` (``RUN/latest`` included) is used as it is.

Why so: Lightning calls a ``CheckpointIO`` on rank 0 alone, while ckptd's save is collective once
torch.distributed is initialised, so the plugin saves inside :func:`ckptd_client.solo` (rank 0 of a
world of one; DDP's state is replicated, nothing is lost); each rank loads the whole checkpoint the
same way. Lightning hands ``load_checkpoint`` a path and wants the dict back, while ckptd fills a
state dict in place, so every save records the dict's structure (containers and key types, as JSON,
inline in the manifest) and a load rebuilds it, tensors shaped from the manifest. Lightning's own
objects (loop progress, callback states, hyper-parameters as a plain dict, scheduler states) are
plain data, stored as JSON or as ``torch.save`` bytes that load with ``weights_only=True``: no
``trust_objects`` needed. Lightning's FSDP strategies do not call a ``CheckpointIO`` for sharded
state at all (docs/integrations.md).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import PurePath
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO

from ckptd_schemas import (
    CheckpointBeingDeleted, CheckpointLeased, CheckpointNotFound, InvalidRequest, StateDictMismatch, parse_ref,
)

from .._dist import solo
from .._save import SaveHandle
from ckptd_schemas.format.assemble import torch_dtype
from ..client import CheckpointClient

__all__ = ["STRUCTURE_KEY", "SCHEME", "CkptdCheckpointIO", "name_for", "structure_of", "template_of"]

log = logging.getLogger(__name__)

SCHEME = "ckptd://"
STRUCTURE_KEY = "ckptd_structure"
"""The extra top-level key a save adds: the checkpoint dict's structure as a JSON string."""


def name_for(path: str | PurePath) -> str:
    """The checkpoint NAME of a Lightning path: its file name without ``.ckpt``, ``=`` dropped, other
    characters outside ``[A-Za-z0-9._-]`` as ``_``."""
    stem = PurePath(str(path)).name
    stem = stem[:-len(".ckpt")] if stem.endswith(".ckpt") else stem
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace("=", "")).lstrip("._-")[:128]
    if not name:
        raise InvalidRequest(f"checkpoint path {str(path)!r} gives no ckptd name", path=str(path))
    return name


def _node(value: Any, path: str) -> Any:
    """JSON for one value: ``{"d": [[key, child], ...]}`` (an int key stays a JSON number),
    ``{"l": [...]}``, ``"t"`` (a tensor) or ``None`` (an object, stored under its own key). Lists are
    walked as ckptd walks them: only when they hold tensors or containers (else the list is one object)."""
    if isinstance(value, torch.Tensor):
        return "t"
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if type(k) not in (str, int):
                raise InvalidRequest(f"checkpoint key {path + '.' if path else ''}{k!r}: a {type(k).__name__} key; "
                                     f"ckptd stores dicts with str or int keys", key=f"{path}.{k!r}")
            items.append([k, _node(v, f"{path}.{k}" if path else str(k))])
        return {"d": items}
    if isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in value):
        return {"l": [_node(v, f"{path}.{i}") for i, v in enumerate(value)]}
    return None


def structure_of(checkpoint: dict) -> str:
    """The JSON structure of a checkpoint dict (containers, key types, where tensors are)."""
    return json.dumps(_node(checkpoint, ""), separators=(",", ":"))


def template_of(structure: str, tensors: dict[str, tuple[list[int], str]], ref: str) -> dict:
    """A state dict to load into: the structure with empty tensors (shapes and dtypes from the
    manifest, ``{fqn: (shape, dtype)}``) and ``None`` for objects."""

    def build(node: Any, path: str) -> Any:
        if node == "t":
            if path not in tensors:
                raise StateDictMismatch(f"{ref}: its structure names tensor {path!r}, which it does not hold",
                                        ref=ref, key=path)
            shape, dtype = tensors[path]
            return torch.empty(shape, dtype=torch_dtype(dtype))
        if isinstance(node, dict) and "d" in node:
            return {k: build(child, f"{path}.{k}" if path else str(k)) for k, child in node["d"]}
        if isinstance(node, dict) and "l" in node:
            return [build(child, f"{path}.{i}") for i, child in enumerate(node["l"])]
        return None

    return build(json.loads(structure), "")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


class CkptdCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` over a ckptd service.

    Args:
        run: the ckptd run every path of this trainer saves to.
        client: a ``CheckpointClient`` (kept open: its owner closes it); default one made on first
            use from ``url`` and ``client_options``, closed by ``teardown``.
        url: the service's URL (default ``$CKPTD_URL``, else ``http://127.0.0.1:8470``).
        wait: ``True`` (default): ``save_checkpoint`` returns once the checkpoint is committed, so that
            ``ModelCheckpoint`` removes the previous one only after its successor exists. ``False``:
            it returns once the state is copied to host memory; the upload is waited for at the next
            save, remove, load or ``teardown``.
        client_options: keyword arguments of ``CheckpointClient`` (``compression``, ``safe_globals``, ...).
    """

    def __init__(self, run: str, client: CheckpointClient | None = None, *, url: str | None = None,
                 wait: bool = True, **client_options: Any) -> None:
        parse_ref(f"{run}/latest")  # checks the run's name now, not at the first save
        self.run = run
        self.url = url
        self.wait = wait
        self.client_options = client_options
        self._client = client
        self._own_client = client is None
        self._pending: SaveHandle | None = None
        self.removals: list[dict] = []  # what each remove_checkpoint got back from the service
        #: the checkpoint of another run this trainer resumed from (``RUN/NAME``): every later save
        #: records it as its parent (lineage across runs: docs/retention.md)
        self.parent: str | None = None

    @property
    def client(self) -> CheckpointClient:
        if self._client is None:
            self._client = CheckpointClient(self.url, **self.client_options)
        return self._client

    def __getstate__(self) -> dict:  # ddp_spawn pickles the strategy: the client stays behind
        state = dict(self.__dict__)
        state["_client"], state["_pending"] = (None if self._own_client else self._client), None
        return state

    def ref_for(self, path: str | PurePath) -> str:
        """The ref a Lightning path stands for."""
        text = str(path)
        if text.startswith(SCHEME):
            return str(parse_ref(text[len(SCHEME):]))
        return str(parse_ref(f"{self.run}/{name_for(text)}"))

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | PurePath,
                        storage_options: Any | None = None) -> None:
        ref = self.ref_for(path)
        if storage_options is not None:
            raise InvalidRequest(f"{ref}: CkptdCheckpointIO takes no storage_options", ref=ref)
        if STRUCTURE_KEY in checkpoint:
            raise InvalidRequest(f"{ref}: the checkpoint already has a key {STRUCTURE_KEY!r}", ref=ref,
                                 key=STRUCTURE_KEY)
        self._settle()
        step = checkpoint.get("global_step")
        state = {**checkpoint, STRUCTURE_KEY: structure_of(checkpoint)}
        # the checkpoint resumed from, when of another run than this save's
        parent = self.parent if self.parent is not None and parse_ref(self.parent).run != parse_ref(ref).run else None
        with solo():
            handle = self.client.save(state, ref, step=step if isinstance(step, int) else None, parent=parent)
        if self.wait:
            handle.wait()
        else:
            self._pending = handle

    def load_checkpoint(self, path: str | PurePath, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict of ``path`` (``ckptd://RUN/latest`` allowed). Objects are always decoded
        as ``weights_only=True`` would (plus the client's ``safe_globals``), unless the client was made
        with ``trust_objects=True``; ``map_location`` may be a device or a device's name."""
        ref = self.ref_for(path)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise InvalidRequest(f"{ref}: map_location must be a device or its name, not "
                                 f"{type(map_location).__name__}", ref=ref)
        self._settle()
        manifest = self.client.manifest(ref)
        held = f"{manifest.run}/{manifest.name}"  # RUN/latest resolved once
        structure = next((o.value for o in manifest.objects if o.name == STRUCTURE_KEY and o.encoding == "json"),
                         None)
        if not isinstance(structure, str):
            raise StateDictMismatch(f"{held} was not saved by CkptdCheckpointIO: it has no {STRUCTURE_KEY!r}",
                                    ref=held, key=STRUCTURE_KEY)
        tensors = {t.name: (list(t.shape), str(t.dtype)) for t in manifest.tensors}
        state = template_of(structure, tensors, held)
        state[STRUCTURE_KEY] = None
        with solo():
            self.client.load(state, held)
        state.pop(STRUCTURE_KEY)
        if manifest.run != self.run:  # resumed from another run: the lineage the next saves record
            self.parent = held
        return _to(state, torch.device(map_location)) if map_location is not None else state

    def remove_checkpoint(self, path: str | PurePath) -> None:
        """Ask the service to delete the checkpoint; one that retention protects (the newest, the
        newest verified, a leased one, a parent of another run's checkpoint) stays, with the reason
        logged and kept in ``removals``; one that is not there is skipped."""
        ref = self.ref_for(path)
        self._settle()
        try:
            result = dict(self.client.remove(ref))
        except CheckpointNotFound:
            result = {"ref": ref, "removed": False, "reason": "not found"}
        except (CheckpointLeased, CheckpointBeingDeleted) as e:  # a reader holds it, or it is being deleted
            result = {"ref": ref, "removed": False, "reason": e.message}
        result.setdefault("ref", ref)
        self.removals.append(result)
        if not result.get("removed"):
            log.info("ckptd kept %s: %s", ref, result.get("reason"))

    def teardown(self) -> None:
        try:
            self._settle()
        finally:
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None
