"""The durable tier: copy each committed checkpoint from the fast tier, verified (``ckptd serve --durable``).

With a durable tier (:class:`~.tiers.TieredStorage`), a save commits on the fast tier
("committed locally"); this module makes it **durable**: the durable tier then holds the checkpoint
visibly (its marker, its manifest, every data file) with the manifest digest of the fast tier's
marker. :meth:`DurableCopier.state` decides whether a checkpoint is durable, and nothing else does;
the durable tier alone is a complete ckptd root (``ckptd serve --root`` it, or ``ckptd ls --root``).

Call order (:meth:`DurableCopier.start`, then one background thread per service):

0. :meth:`DurableCopier.adopt`, at start and every ``ADOPT_EVERY`` scans: the markers of the
   durable tier's checkpoints that the fast tier lacks (a new, emptied or partly lost fast tier)
   are copied to it, so that the fast tier alone knows every name taken
   (:mod:`.tiers`). A fast tier that never adopted (no ``TIERS.json``) does not
   start while the durable tier cannot be listed; one that did starts, and serves what it holds.
1. :meth:`DurableCopier.scan`, woken by every commit here (:meth:`DurableCopier.notify`) and every
   ``scan_seconds`` otherwise (commits of other replicas and of reshard workers, and what a crash
   left undone): each checkpoint visible on the fast tier and not durable is copied, oldest first.
2. :meth:`DurableCopier.copy`: every data file is read from the fast tier once, judged by the one
   checker (:func:`~.checker.judge`, the commit's and ``ckptd verify``'s) and written to the
   durable tier as it passes; any problem refuses the copy (the fast copy is damaged: recorded in ``NOT_DURABLE.json``,
   not retried for that manifest). Then ``SESSION.json``, the manifest (its bytes hash to the
   marker's digest), and last the marker, created if absent, so the durable tier shows nothing
   until everything it names is there.
3. :meth:`DurableCopier.trim`: the fast tier keeps the ``keep_fast`` newest checkpoints of each run;
   an older one's data leaves the fast tier once it is durable and not leased, and its marker stays
   (it is then read from the durable tier, which keeps it under the run's retention policy; that
   policy deletes from both tiers).

A crash anywhere before the marker leaves the durable copy invisible and the fast copy intact; the
next scan (at start, then periodically) copies it again, and each object write is whole, so a
rewrite replaces what the crash left. Replicas sharing a fast root may copy the same checkpoint at
once: the marker is created once, and the copies are the same bytes.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from ckptd_schemas import CkptdError, Conflict, CorruptCheckpoint, Manifest, StorageError

from ..storage import Writer
from .tiers import ADOPTED, TieredStorage
from .paths import Committed, Marker, Paths
from .leases import Leases
from .checker import StorageFiles, judge
from .visibility import Visibility, order_key

__all__ = ["Copied", "DurableCopier", "DurableState"]

log = logging.getLogger("ckptd.durable")

WINDOW = 16 << 20  # bytes per read and write while copying (one request per window on object stores)
PARALLEL_FILES = 4  # files copied at once (object stores: one request each in flight)


TIERS_KEY = "TIERS.json"  # on the fast tier, once it adopted the durable tier's markers
ADOPT_EVERY = 30  # scans between two adoptions while running (5 minutes at the default scan interval)


class _Copies(StorageFiles):
    """The checker's source for a durable copy: reads each file's windows from the fast tier, in order,
    and writes them to the durable tier as they pass; a file's durable object is committed once the
    checker found nothing wrong in it (:meth:`done`), and dropped otherwise. Nothing on the durable
    tier counts before the marker, which :meth:`DurableCopier.copy` creates only when every file held."""

    def __init__(self, tiers: TieredStorage, key_of: Callable[[str], str], manifest: Manifest, ref: str) -> None:
        super().__init__(tiers.fast, key_of)
        self.durable, self.sizes, self.ref = tiers.durable, {f: e.size for f, e in manifest.files.items()}, ref
        self._writers: dict[str, Writer] = {}
        self._lock = threading.Lock()

    def _writer(self, file: str) -> Writer:
        with self._lock:
            w = self._writers.get(file)
            if w is None:
                w = self._writers[file] = self.durable.open_write(self.key_of(file))
            return w

    def read_into(self, file: str, start: int, view: memoryview) -> int:
        # A fast file absent or resized is damage (CorruptCheckpoint: the copy is refused), not a pause.
        self.storage.read_committed_into(self.key_of(file), start, view, self.sizes[file], ref=self.ref)
        self._writer(file).write(view)
        return len(view)

    def done(self, file: str, ok: bool) -> None:
        w = self._writer(file)  # an empty file has no window: its object is created here
        if ok:
            w.commit()
        else:
            w.abort()

    def abort(self) -> None:
        for w in list(self._writers.values()):
            w.abort()


@dataclass(frozen=True)
class DurableState:
    """Whether ``RUN/NAME`` (as committed with ``manifest_xxh3``) is durable, or why it cannot become so."""

    durable: bool
    error: dict | None = None  # the typed error body, when the copy was refused


@dataclass(frozen=True)
class Copied:
    """One checkpoint made durable by this process."""

    run: str
    name: str
    bytes: int
    lag_seconds: float  # from its commit to its durable marker


@dataclass
class DurableCopier:
    """Copies committed checkpoints of ``tiers.fast`` to ``tiers.durable`` (module docstring)."""

    tiers: TieredStorage
    keep_fast: int = 2
    scan_seconds: float = 10.0
    on_copied: Callable[[Copied], None] = lambda _: None  # the service's metrics set both
    on_refused: Callable[[str, CkptdError], None] = lambda ref, e: None
    pending: dict[str, datetime] = field(default_factory=dict)  # ref -> committed_at, not durable yet

    def __post_init__(self) -> None:
        self.fast_vis, self.durable_vis = Visibility(self.tiers.fast), Visibility(self.tiers.durable)
        self.leases = Leases(self.tiers)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one scan at a time in this process
        self._failing = False  # the last copy attempted was interrupted: further interruptions log quietly

    # -- the one rule ------------------------------------------------------------------------------
    def state(self, run: str, name: str, manifest_xxh3: str) -> DurableState:
        """Durable iff the durable tier shows ``run/name`` visible with this manifest digest (while it
        cannot be read, not durable: a waiter keeps waiting)."""
        try:
            c = self.durable_vis.check(run, name)
        except StorageError:
            return DurableState(False)
        if c is not None and c.digest == manifest_xxh3:
            return DurableState(True)
        rec = self.tiers.fast.read_json_or_none(Paths.not_durable(run, name))
        if rec is not None and rec.get("manifest_xxh3") == manifest_xxh3:
            return DurableState(False, rec["error"])
        return DurableState(False)

    def lag_seconds(self) -> float:
        """Age of the oldest committed checkpoint not durable yet (0 when none)."""
        oldest = min(list(self.pending.values()), default=None)  # a snapshot: the copier's thread changes it
        return 0.0 if oldest is None else max(0.0, (datetime.now(timezone.utc) - oldest).total_seconds())

    # -- 0. adopt ----------------------------------------------------------------------------------
    def adopt(self) -> int:
        """Copy to the fast tier every marker of a checkpoint visible on the durable tier that the fast
        tier lacks; return how many. Reads of the fast tier and one listing of the durable tier's
        names, plus the durable markers of names the fast tier lacks."""
        fast, n = self.tiers.fast, 0
        for run in self.durable_vis.runs():
            for name in self.durable_vis.names(run):
                if fast.exists(Paths.marker(run, name)):
                    continue
                c = self.durable_vis.check(run, name)
                if c is not None and fast.create_if_absent(Paths.marker(run, name), c.marker.model_dump_json().encode()):
                    n += 1
        fast.put(TIERS_KEY, json.dumps({"durable": self.tiers.durable.url}).encode())
        fast.put(ADOPTED, b"{}")  # inside runs/: gone with a lost runs/, which the next scan then adopts again
        if n:
            log.warning("durable tier: the fast tier lacked %d checkpoint markers of %s and took them (a new or "
                        "emptied fast tier)", n, self.tiers.durable.url)
        return n

    # -- background thread -----------------------------------------------------------------------
    def start(self) -> None:
        """Adopt, then scan in the background. Adopting may fail (the durable tier unreachable) only on a
        fast tier that adopted this durable tier before: a new or emptied one raises, and the service
        does not start."""
        try:
            self.adopt()
        except StorageError as e:
            if self.tiers.fast.read_or_none(TIERS_KEY) is None:
                raise
            log.warning("durable tier unreachable at start (%s); serving from the fast tier, which holds every "
                        "name it committed; copies resume when it is back", e.message)
        self._thread = threading.Thread(target=self._loop, name="ckptd-durable", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def notify(self, *_: object) -> None:
        """A commit happened here: scan now (an action after each commit: ``events.AfterCommit``)."""
        self._wake.set()

    def _loop(self) -> None:
        scans = 0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if scans % ADOPT_EVERY == ADOPT_EVERY - 1 or not self.tiers.fast.exists(ADOPTED):
                    self.adopt()  # markers the fast tier lost while running come back (a lost runs/: at once)
                self.scan()
            except Exception:  # noqa: BLE001 - a failed scan must not stop the copier; the next one retries
                log.exception("durable tier: scan failed")
            scans += 1
            self._wake.wait(self.scan_seconds)

    # -- 1. scan -----------------------------------------------------------------------------------
    def scan(self) -> list[Copied]:
        """Copy every fast-tier checkpoint that is not durable, then trim each run's fast copies. Each
        checkpoint's durable state is read once per scan, and serves both."""
        with self._lock:
            here: dict[str, list[Committed]] = {}
            durable: set[str] = set()
            todo: list[Committed] = []
            for run in self.fast_vis.runs():
                try:
                    here[run] = self.on_fast(run)
                    for c in here[run]:
                        st = self.state(c.run, c.name, c.digest)
                        if st.durable:
                            durable.add(c.ref)
                        elif st.error is None:
                            todo.append(c)
                except CkptdError as e:
                    log.warning("durable tier: run %s skipped: %s", run, e.message)
            self.pending = {c.ref: c.committed_at for c in todo}
            done = []
            for c in sorted(todo, key=lambda c: c.committed_at):
                if self._stop.is_set():
                    break
                if not self._on_fast(c):  # removed since the listing (retention, rm): nothing to copy, nothing written
                    self.pending.pop(c.ref, None)
                    continue
                try:
                    done.append(self.copy(c))
                except StorageError as e:  # transient: the next scan tries again
                    (log.debug if self._failing else log.warning)(
                        "durable tier: copy of %s interrupted (retried every scan; logged again once a copy "
                        "succeeded): %s", c.ref, e.message)
                    self._failing = True
                    continue
                except CkptdError as e:
                    self._refuse(c, e)
                    continue
                durable.add(c.ref)
                self.pending.pop(c.ref, None)
                self._failing = False
            for run, checkpoints in here.items():
                try:
                    self.trim(run, checkpoints, durable)
                except CkptdError as e:
                    log.warning("durable tier: trim of run %s skipped: %s", run, e.message)
            return done

    def on_fast(self, run: str) -> list[Committed]:
        """The run's checkpoints whose whole copy is on the fast tier (visible there), oldest first;
        a checkpoint whose fast copy was dropped (its marker alone left) is not looked into."""
        out = []
        for name in self.fast_vis.names(run):
            m = self.fast_vis.marker(run, name)
            if isinstance(m, Marker) and self.tiers.fast.exists(Paths.manifest(run, name, m.session, m.manifest_xxh3)):
                c = self.fast_vis.check_marker(run, name, m)
                if c is not None:
                    out.append(c)
        return sorted(out, key=order_key)

    def _refuse(self, c: Committed, e: CkptdError) -> None:
        log.error("durable tier: %s cannot be made durable: %s", c.ref, e.message)
        rec = {"manifest_xxh3": c.digest, "error": e.to_body()["error"]}
        self.tiers.fast.put(Paths.not_durable(c.run, c.name), json.dumps(rec).encode())
        self.pending.pop(c.ref, None)
        self.on_refused(c.ref, e)

    # -- 2. copy -----------------------------------------------------------------------------------
    def copy(self, c: Committed) -> Copied:
        """Copy the visible fast-tier checkpoint ``c`` to the durable tier, data first, marker last."""
        fast, durable = self.tiers.fast, self.tiers.durable
        self._check_name_free(c)
        try:
            manifest = self.fast_vis.manifest(c)
            raw = self.fast_vis.manifest_bytes(c)
            self._copy_files(c, manifest)
            meta = fast.read_or_none(Paths.session_meta(c.run, c.name, c.session))
            if meta is not None:
                durable.put(Paths.session_meta(c.run, c.name, c.session), meta)
            durable.put(c.manifest_key, raw)
        except CkptdError:
            if self._on_fast(c):
                raise  # a damaged fast copy, a failing store: refused or retried as it says
        if not self._on_fast(c):  # deleted (retention, rm) while it was copied: its files were read from under it
            self._take_back(c)
            raise StorageError(f"{c.ref} left the fast tier while it was copied (removed by retention); what the "
                               f"copy wrote to the durable tier is removed", ref=c.ref)
        if not durable.create_if_absent(Paths.marker(c.run, c.name), c.marker.model_dump_json().encode()):
            self._check_name_free(c)  # created meanwhile: by another replica's copy of this checkpoint, or not
        lag = max(0.0, (datetime.now(timezone.utc) - c.committed_at).total_seconds())
        done = Copied(c.run, c.name, manifest.total_bytes + len(raw), lag)
        log.info("durable tier: %s is durable (%d bytes, %.2f s after its commit)", c.ref, done.bytes, lag)
        self.on_copied(done)
        return done

    def _on_fast(self, c: Committed) -> bool:
        """Whether the fast tier's marker still names ``c`` (the same session and manifest)."""
        m = self.fast_vis.marker(c.run, c.name)
        return isinstance(m, Marker) and m.session == c.session and m.manifest_xxh3 == c.digest

    def _take_back(self, c: Committed) -> None:
        """Remove what a copy of ``c`` wrote to the durable tier before its marker: no marker names it there,
        so it is invisible and would stay behind for good; where neither tier names a checkpoint under the
        name any more and nothing else is stored under it, the name's (empty) directories go too. Under a
        durable marker naming ``c``'s session (another replica finished the copy), nothing is removed: a
        durable checkpoint is never taken back by a copier."""
        there = self.durable_vis.marker(c.run, c.name)
        if isinstance(there, Marker) and there.session == c.session:
            return
        durable = self.tiers.durable
        durable.delete_tree(Paths.session(c.run, c.name, c.session))
        left = durable.list(Paths.ckpt(c.run, c.name))  # at most an empty "sessions", once the session went
        if (there is None and self.fast_vis.marker(c.run, c.name) is None and left in ([], ["sessions"])
                and not durable.list(Paths.sessions(c.run, c.name))):
            durable.delete_tree(Paths.ckpt(c.run, c.name))  # the name is gone from both tiers: no empty directory

    def _copy_files(self, c: Committed, manifest: Manifest) -> None:
        """Every data file read from the fast tier once, judged by the one checker (every chunk, frame,
        replica and file digest, as at the commit and in ``ckptd verify``) while each window is written
        to the durable tier; the durable objects are committed only when the checker found nothing
        wrong, and none is left otherwise. Files that incremental saves linked are read and copied like
        the others: the durable tier holds nothing that was not hashed on its way there."""
        copies = _Copies(self.tiers, lambda f: Paths.file(c.run, c.name, c.session, f), manifest, c.ref)
        try:
            verdict = judge(manifest, copies, jobs=PARALLEL_FILES, read_size=WINDOW)
        except BaseException:
            copies.abort()
            raise
        if not verdict.ok:
            first = verdict.problems[0]
            raise CorruptCheckpoint(f"{c.ref}: its fast copy does not match its manifest: {first.message}",
                                    ref=c.ref, **{k: v for k, v in first.details.items() if v is not None})

    def _check_name_free(self, c: Committed) -> None:
        """Refuse (``Conflict``) when the durable tier has a marker under ``c``'s name for another manifest:
        its checkpoint is kept, and ``c`` stays on the fast tier only."""
        there = self.durable_vis.marker(c.run, c.name)
        if there is None or (isinstance(there, Marker) and there.manifest_xxh3 == c.digest):
            return
        what = f"manifest {there.manifest_xxh3}" if isinstance(there, Marker) else "a marker that does not parse"
        raise Conflict(f"{c.ref}: the durable tier holds another checkpoint under this name ({what}); this one "
                       f"(manifest {c.digest}) stays on the fast tier only", ref=c.ref)

    # -- 3. trim -----------------------------------------------------------------------------------
    def trim(self, run: str, here: list[Committed], durable: set[str]) -> list[str]:
        """Drop the fast copies (their data, not their markers) of the run's checkpoints beyond the
        ``keep_fast`` newest, where durable (``durable``: the refs this scan found or made durable) and
        not leased; ``here``: the run's checkpoints on the fast tier, oldest first. Return their names."""
        dropped = []
        for c in here[:max(0, len(here) - self.keep_fast)]:
            if c.ref not in durable or self.leases.active(run, c.name):
                continue
            self.tiers.fast.delete_tree(Paths.sessions(run, c.name))  # the marker stays: the name is taken
            dropped.append(c.name)
        if dropped:
            log.info("durable tier: fast copies of %s/%s dropped (durable; the fast tier keeps the %d newest)",
                     run, ",".join(dropped), self.keep_fast)
        return dropped

