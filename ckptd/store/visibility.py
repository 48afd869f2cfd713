"""Which checkpoints exist: the visibility rule, decided here and nowhere else (docs/design.md §2 item 4).

A checkpoint ``RUN/NAME`` is **visible** if and only if

1. its ``COMMITTED`` marker parses (:class:`~.layout.Marker`),
2. the manifest it names (``manifest-<digest>.json`` in the session it names) exists, hashes to
   the marker's ``manifest_xxh3`` and parses as a :class:`~ckptd_schemas.Manifest`,
3. and marker and manifest agree on the ref, the session, the step, ``derived_from`` and ``parent``.

Every reader asks :class:`Visibility`: listing (``ckptd ls``, ``GET /v1/runs``), ``RUN/latest``,
manifest and file reads, verification, retention, the stale-session sweep, reshard sources, and
the write side's "is this ref committed, and by which session". A checkpoint that fails the rule is
invisible: it is logged once (per ref and reason), reported to ``on_invisible`` (the service counts
it in ``ckptd_invisible_checkpoints_total``) and never makes another checkpoint or run fail;
``RUN/latest`` falls back to the newest visible trainer checkpoint. Checkpoints are ordered by the
step that marker and manifest agree on, so a single edited file cannot reorder a run.

``RUN/latest`` is decided here too (:meth:`Visibility.latest`): the newest visible trainer
checkpoint **not known to be bad**. Known bad means its recorded verification of the manifest
committed now failed (:func:`.records.known_bad` reads the record; this module stays the one
reader of markers). A checkpoint never verified, or verified about another manifest, is not known
to be bad. The checkpoints passed over are returned with the reason (:class:`Skipped`), so a load
and ``ckptd show`` can say why ``latest`` is not the newest one.

Call order: :meth:`Visibility.marker` is the one reader of markers (the write side asks it whether
a ref is taken); :meth:`Visibility.check` applies the rule to one ref; :meth:`Visibility.listing`,
:meth:`Visibility.resolve` and :meth:`Visibility.manifest` are built on it; :meth:`Visibility.latest`
on the listing, and :meth:`Visibility.resolve_ref` (``resolve`` with what ``latest`` skipped) on both.

Cost: a check reads the marker and stats the manifest (:meth:`Storage.stamp`). The manifest's bytes
are read, hashed and parsed only when its stamp is new; the verdict is cached by (key, stamp) and
the parsed manifest by digest, never by name, so a manifest changed on storage is seen at once.
The first look at a checkpoint (its manifest read, hashed and parsed; its load tree and every
tensor's interval index) is built once per process, whatever the number of callers asking at once:
they wait on the one build (:class:`~.flights.OneAtATime`) and take it from the cache, which is bounded by
``cache_bytes`` (``MEMORY_PER_MANIFEST_BYTE`` per byte of JSON) and reports each build
(``on_build``) and its size (:meth:`Visibility.cache_usage`).

A run's listing costs one marker read and one stat per checkpoint of the run. What summarizes runs
(``GET /v1/runs``, the web view) reads :meth:`Visibility.recent_listing`: one listing per run shared
by every caller for :data:`LISTING_SECONDS` (concurrent callers wait for the one read, ``listing``
in ``on_build``), so a storm of listings costs what one does. A commit through this object forgets
its run's (:meth:`forget_listing`); another replica's commit shows within :data:`LISTING_SECONDS`.
What a load resolves (``latest``) always reads the listing now.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

from pydantic import ValidationError

from ckptd_schemas import (
    LATEST, CheckpointNotFound, CkptdError, CorruptCheckpoint, InvalidName, Manifest, NotFound, StorageError,
    check_name, check_run, check_session,
)
from ckptd_schemas.loadtree import LoadTree

from ..storage import Storage
from .flights import OneAtATime
from .gcpause import gc_paused
from ckptd_schemas.filedigest import xxh3_hex
from .paths import Committed, Marker, Paths, read_small, regular_file
from .records import known_bad

__all__ = ["BadMarker", "Committed", "Latest", "Skipped", "Visibility", "manifest_file_name"]

log = logging.getLogger("ckptd.store")

#: A ``COMMITTED`` marker is a few hundred bytes; a larger object there is not read, and the
#: checkpoint is invisible.
MAX_MARKER_BYTES = 64 << 10

_DIGEST = re.compile(r"[0-9a-f]{16}")

#: Memory of a parsed manifest per byte of its JSON, its interval indexes and load tree included, as the
#: cache counts it (about 5 measured for the parsed manifest alone: BENCHMARKS.md, Figures behind the
#: code; an index and a tree add about 56 bytes a chunk, of 60 to 100 bytes of JSON).
MEMORY_PER_MANIFEST_BYTE = 6
#: What the parsed manifests a :class:`Visibility` keeps may take, as counted above.
DEFAULT_CACHE_BYTES = 1 << 30
LISTING_SECONDS = 2.0  # a run's listing is shared this long by what summarizes runs (recent_listing)
MAX_LISTINGS = 256  # runs whose recent listing is kept


def manifest_file_name(digest: str) -> str:
    return f"manifest-{digest}.json"


class BadMarker(NamedTuple):
    """A ``COMMITTED`` object that is there but does not parse: the ref is taken, and invisible."""

    reason: str


@dataclass(frozen=True)
class Skipped:
    """A trainer checkpoint newer than the one ``RUN/latest`` resolved to, passed over because it is
    known to be bad; ``reason`` says why (``verification failed at ...: <first problem>``)."""

    ref: str
    reason: str

    def as_json(self) -> dict:
        return {"ref": self.ref, "reason": self.reason}


@dataclass(frozen=True)
class Latest:
    """What ``RUN/latest`` resolves to in one listing (:meth:`Visibility.latest`)."""

    #: the newest visible trainer checkpoint not known to be bad (None: there is none)
    checkpoint: Committed | None
    #: the newer trainer checkpoints passed over as known to be bad, newest first
    skipped: tuple[Skipped, ...] = ()
    #: the newest visible trainer checkpoint, known to be bad or not (retention always keeps it)
    newest: Committed | None = None


def order_key(c: Committed) -> tuple:
    """Oldest first: by step (as a number), then the manifest's creation time, then name. Each is
    bound by the manifest's digest (the name by the path that marker and manifest agree on); the
    marker's own ``committed_at`` is not, so an edit of the marker alone cannot reorder a run."""
    created = c.created_at.timestamp() if c.created_at is not None else float("-inf")
    return (c.step if c.step is not None else -1, created, c.name)


class _Invisible(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class Visibility:
    """The visibility rule over one :class:`Storage`, with caches that never outlive the bytes."""

    def __init__(self, storage: Storage, *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 on_invisible: Callable[[str, str, str], None] | None = None) -> None:
        self.storage = storage
        self.on_invisible = on_invisible  # (ref, reason, message), once per ref and reason
        # (manifest key, stamp) -> what those bytes say: (digest, run, name, session, step, derived_from,
        # created_at)
        self._verdicts: dict[tuple[str, str], tuple] = {}
        # digest -> [parsed manifest, its estimated memory, its load tree once built]: least recently used first
        self._manifests: OrderedDict[str, list] = OrderedDict()
        self._cache_bytes, self._cached_bytes = cache_bytes, 0
        self._reported: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._listings: OrderedDict[str, tuple[float, list[Committed]]] = OrderedDict()  # recent_listing's
        self._one_at_a_time = OneAtATime()  # work done once for concurrent callers
        # a first look built here: "manifest" (read, hashed, parsed) or "load_tree" (with its interval indexes)
        self.on_build: Callable[[str], None] | None = None

    # -- the one marker reader ----------------------------------------------------------------
    def marker(self, run: str, name: str) -> Marker | BadMarker | None:
        """None: no marker (the ref is free). :class:`BadMarker`: one is there but does not parse, or is no
        marker at all (:func:`.paths.read_small`: too large; on a local root, not a regular readable file)."""
        raw, why = read_small(self.storage, Paths.marker(run, name), MAX_MARKER_BYTES)
        if raw is None:
            return None if why is None else BadMarker(f"COMMITTED marker {why}"[:300])
        try:
            m = Marker.model_validate_json(raw)
            check_session(m.session)
            if not _DIGEST.fullmatch(m.manifest_xxh3):
                raise ValueError(f"manifest_xxh3 {m.manifest_xxh3[:40]!r} is not an XXH3 digest (16 hex digits)")
        except (ValidationError, ValueError, CkptdError) as e:
            first = e.errors()[0]["msg"] if isinstance(e, ValidationError) and e.errors() else str(e)
            return BadMarker(f"COMMITTED marker does not parse: {first}"[:300])
        return m

    def _manifest_stamp(self, key: str, m: Marker) -> str | None:
        """The manifest's storage stamp (None: absent); on a local root, anything there that is not a
        regular readable file is invisible's ``manifest_missing``, never opened."""
        path = self.storage.local_path(key)
        if path is not None:
            st, why = regular_file(path)
            if why is not None:
                raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names ({m.manifest}) {why}")
            if st is None:
                return None
        try:
            return self.storage.stamp(key)
        except StorageError as e:
            if path is None:
                raise
            raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names ({m.manifest}) "
                                                 f"cannot be read: {e.message}") from None

    def _read_manifest(self, key: str, m: Marker) -> bytes | None:
        """The manifest's bytes (None: absent), read only from a regular file on a local root."""
        if self._manifest_stamp(key, m) is None:
            return None
        try:
            return self.storage.read_or_none(key)
        except StorageError as e:
            if self.storage.local_path(key) is None:
                raise
            raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names ({m.manifest}) "
                                                 f"cannot be read: {e.message}") from None

    # -- the rule --------------------------------------------------------------------------------
    def check(self, run: str, name: str) -> Committed | None:
        """The visible checkpoint ``run/name`` (a concrete name), or None: absent or invisible."""
        m = self.marker(run, name)
        return None if m is None else self.check_marker(run, name, m)

    def check_marker(self, run: str, name: str, m: Marker | BadMarker) -> Committed | None:
        """:meth:`check` for a marker the caller has already read (one read, so no race between two)."""
        try:
            return self._check(run, name, m)
        except _Invisible as e:
            self._report(f"{run}/{name}", e.reason, e.message)
            return None

    def _check(self, run: str, name: str, m: Marker | BadMarker) -> Committed:
        if isinstance(m, BadMarker):
            raise _Invisible("marker_malformed", m.reason)
        if m.ref != f"{run}/{name}":
            raise _Invisible("disagrees", f"its COMMITTED marker names ref {m.ref!r}")
        if m.manifest != manifest_file_name(m.manifest_xxh3):
            raise _Invisible("disagrees", f"its COMMITTED marker names manifest {m.manifest!r}, not the file of "
                                          f"digest {m.manifest_xxh3}")
        key = f"{Paths.session(run, name, m.session)}/{m.manifest}"
        stamp = self._manifest_stamp(key, m)
        if stamp is None:
            raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names ({m.manifest}) is missing")
        claim = (m.manifest_xxh3, run, name, m.session, m.step, m.derived_from, m.parent)
        said = self._verdict(key, stamp, m.manifest_xxh3)
        if said is None:
            said = _says(m.manifest_xxh3, self._load(run, name, m, key, stamp))
        if said[:7] != claim:
            raise _Invisible("disagrees", _disagreement(said, m))
        return Committed(run, name, m, key, said[7])

    def _verdict(self, key: str, stamp: str, digest: str) -> tuple | None:
        """What the manifest ``key`` of that stamp says, if a check or the commit found it of ``digest``."""
        if not stamp:
            return None
        with self._lock:
            said = self._verdicts.get((key, stamp))
        return said if said is not None and said[0] == digest else None

    def note_written(self, key: str, digest: str, says: tuple) -> None:
        """The commit wrote the manifest ``key`` (bytes of ``digest``) and knows what it says (run,
        name, session, step, ``derived_from``, ``parent``, created_at): remember the verdict for its
        stamp now, as a check that read it would. A change of the bytes changes the stamp, and the
        next check reads them."""
        try:
            stamp = self.storage.stamp(key)
        except StorageError:
            return
        if stamp:
            with self._lock:
                self._verdicts[(key, stamp)] = (digest, *says)

    def _load(self, run: str, name: str, m: Marker, key: str, stamp: str) -> Manifest:
        """Read, hash and parse the manifest ``key`` (of ``stamp``), once for every concurrent caller:
        the first look at a checkpoint after a start, by 10,000 ranks at once, holds one copy of its
        bytes and one parse; the others wait, then find the verdict and the parsed manifest it left."""
        with self._one_at_a_time(("manifest", key)):
            if self._verdict(key, stamp, m.manifest_xxh3) is not None:
                cached = self.cached(m.manifest_xxh3)
                if cached is not None:
                    return cached
            raw = self._read_manifest(key, m)
            if raw is None:
                raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names ({m.manifest}) is "
                                                     f"missing")
            if xxh3_hex(raw) != m.manifest_xxh3:
                raise _Invisible("manifest_digest", f"its manifest does not hash to the digest its COMMITTED marker "
                                                    f"names ({m.manifest_xxh3})")
            manifest = self.cached(m.manifest_xxh3)
            if manifest is None:
                try:
                    with gc_paused():  # a 1,024-rank manifest is a million small objects
                        manifest = Manifest.model_validate_json(raw)
                except ValidationError as e:
                    first = e.errors()[0] if e.errors() else {}
                    where = ".".join(str(p) for p in first.get("loc", ())) or "manifest"
                    raise _Invisible("manifest_malformed", f"its manifest does not parse at {where}: "
                                                           f"{first.get('msg', 'invalid')}"[:300]) from None
                self._keep(m.manifest_xxh3, manifest, MEMORY_PER_MANIFEST_BYTE * len(raw))
                self._built("manifest")
            del raw
            if stamp:  # taken before the read: a change during the read only makes the next check read again
                with self._lock:
                    if len(self._verdicts) > 100_000:
                        self._verdicts.clear()
                    self._verdicts[(key, stamp)] = _says(m.manifest_xxh3, manifest)
        return manifest

    def cached(self, digest: str) -> Manifest | None:
        """The parsed manifest of that digest if the cache holds it (no I/O): only for a digest a
        marker named just now, since the cache keeps no verdict."""
        with self._lock:
            hit = self._manifests.get(digest)
            if hit is None:
                return None
            self._manifests.move_to_end(digest)
            return hit[0]

    def _keep(self, digest: str, manifest: Manifest, cost: int) -> None:
        """Cache a parsed manifest; evict the least recently used ones past ``cache_bytes`` (the newest
        one stays even when it alone is larger: it is in use)."""
        with self._lock:
            old = self._manifests.pop(digest, None)
            self._cached_bytes += cost - (old[1] if old is not None else 0)
            self._manifests[digest] = [manifest, cost, None]
            while self._cached_bytes > self._cache_bytes and len(self._manifests) > 1:
                _, (_, freed, _) = self._manifests.popitem(last=False)
                self._cached_bytes -= freed

    def cache_usage(self) -> tuple[int, int]:
        """The parsed manifests kept (with their load trees and interval indexes): estimated bytes, entries."""
        with self._lock:
            return self._cached_bytes, len(self._manifests)

    def _built(self, what: str) -> None:
        if self.on_build is not None:
            self.on_build(what)

    def _report(self, ref: str, reason: str, message: str) -> None:
        message = message if len(message) <= 500 else message[:500] + "..."
        with self._lock:
            if (ref, reason) in self._reported:
                return
            if len(self._reported) > 100_000:
                self._reported.clear()
            self._reported.add((ref, reason))
        log.warning("checkpoint %s is invisible: %s", ref, message)
        if self.on_invisible is not None:
            self.on_invisible(ref, reason, message)

    # -- built on the rule ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _visible(self, ref: str) -> Iterator[None]:
        """The rule's refusal inside (``_Invisible``) reported, and raised as :class:`CheckpointNotFound`."""
        try:
            yield
        except _Invisible as e:
            self._report(ref, e.reason, e.message)
            raise CheckpointNotFound(f"checkpoint {ref} is not visible: {e.message}", ref=ref,
                                     reason=e.reason) from None

    def manifest(self, c: Committed) -> Manifest:
        """The parsed manifest of a visible checkpoint, checked against its digest again whenever its
        stamp changed; raises :class:`CheckpointNotFound` if it no longer holds. Agreement with the
        marker needs no second look: it is a property of the bytes, which the digest fixes."""
        with self._visible(c.ref):
            stamp = self._manifest_stamp(c.manifest_key, c.marker)
            if self._verdict(c.manifest_key, stamp or "", c.digest) is not None:
                cached = self.cached(c.digest)
                if cached is not None:
                    return cached
            if stamp is None:
                raise _Invisible("manifest_missing", f"the manifest its COMMITTED marker names "
                                                     f"({c.marker.manifest}) is missing")
            return self._load(c.run, c.name, c.marker, c.manifest_key, stamp)

    def load_tree(self, c: Committed) -> LoadTree:
        """The load tree of a visible checkpoint's manifest (built once per parsed manifest), which must
        have the root its marker names: ``NotFound`` when the marker names none (a checkpoint committed
        before load trees: readers read its manifest), ``CorruptCheckpoint`` when it names another."""
        if c.marker.load_tree is None:
            raise NotFound(f"checkpoint {c.ref} has no load tree (its marker names none): read its manifest",
                           ref=c.ref)
        manifest = self.manifest(c)

        def kept() -> LoadTree | None:
            with self._lock:
                entry = self._manifests.get(c.digest)
                return entry[2] if entry is not None and entry[0] is manifest else None

        tree = kept()
        if tree is None:
            with self._one_at_a_time(("load tree", c.digest)):  # every rank's first request at once: one build
                tree = kept()
                if tree is None:
                    tree = LoadTree(manifest)
                    for t in manifest.tensors:  # every tensor's interval index, once: each answer bisects them
                        t.index
                    self._built("load_tree")
                    with self._lock:
                        entry = self._manifests.get(c.digest)
                        if entry is not None and entry[0] is manifest:
                            entry[2] = tree  # kept, and evicted, with its manifest
        if tree.root != c.marker.load_tree:
            raise CorruptCheckpoint(f"checkpoint {c.ref}: its manifest's load tree is {tree.root}, its COMMITTED "
                                    f"marker names {c.marker.load_tree}", ref=c.ref, file="COMMITTED")
        return tree

    def manifest_bytes(self, c: Committed) -> bytes:
        """The manifest's bytes as stored now, served only if they hash to the marker's digest."""
        with self._visible(c.ref):
            raw = self._read_manifest(c.manifest_key, c.marker)
            if raw is None:
                raise _Invisible("manifest_missing", "its manifest is missing")
            if xxh3_hex(raw) != c.digest:
                raise _Invisible("manifest_digest", "its manifest does not hash to its marker's digest")
        return raw

    def recent_listing(self, run: str) -> list[Committed]:
        """:meth:`listing`, as read at most :data:`LISTING_SECONDS` ago, once for every concurrent caller."""
        check_run(run)  # before it keys anything
        with self._one_at_a_time(("listing", run)):
            with self._lock:
                hit = self._listings.get(run)
            if hit is not None and time.monotonic() - hit[0] < LISTING_SECONDS:
                return hit[1]
            self._built("listing")
            out = self.listing(run)
            with self._lock:
                self._listings[run] = (time.monotonic(), out)
                self._listings.move_to_end(run)
                while len(self._listings) > MAX_LISTINGS:
                    self._listings.popitem(last=False)
            return out

    def forget_listing(self, run: str) -> None:
        """A checkpoint of ``run`` was committed or deleted here: its next :meth:`recent_listing` reads."""
        with self._lock:
            self._listings.pop(run, None)

    def runs(self) -> list[str]:
        """Run names under the root; entries that are not valid run names are skipped."""
        return [r for r in self.storage.list(Paths.runs()) if _valid(check_run, r)]

    def names(self, run: str) -> list[str]:
        """Checkpoint names of ``run`` that could be checkpoints (valid names), visible or not."""
        check_run(run)
        return [n for n in self.storage.list(Paths.run(run)) if n != LATEST and _valid(check_name, n)]

    def listing(self, run: str) -> list[Committed]:
        """The visible checkpoints of ``run``, oldest first (:func:`order_key`)."""
        out = [c for n in self.names(run) if (c := self.check(run, n)) is not None]
        return sorted(out, key=order_key)

    def known_bad(self, c: Committed) -> str | None:
        """Why the visible checkpoint ``c`` is known to be bad, or None (:func:`.records.known_bad`:
        a recorded verification of the manifest committed now that failed)."""
        return known_bad(self.storage, c)

    def latest(self, visible: list[Committed]) -> Latest:
        """What ``RUN/latest`` names among ``visible`` (a :meth:`listing`): the newest trainer checkpoint
        (a step, no ``derived_from``) not known to be bad, and the newer ones skipped, with why.

        Records are read newest first and only until one checkpoint is not known to be bad: one
        read of ``VERIFIED.json`` when the newest is good."""
        trainer = sorted((c for c in visible if c.derived_from is None and c.step is not None), key=order_key)
        skipped: list[Skipped] = []
        for c in reversed(trainer):
            why = self.known_bad(c)
            if why is None:
                return Latest(c, tuple(skipped), trainer[-1])
            skipped.append(Skipped(c.ref, why))
        return Latest(None, tuple(skipped), trainer[-1] if trainer else None)

    def resolve(self, run: str, name: str) -> Committed:
        """The visible checkpoint ``run/name`` (``latest``: the newest visible trainer checkpoint not
        known to be bad)."""
        return self.resolve_ref(run, name)[0]

    def resolve_ref(self, run: str, name: str) -> tuple[Committed, tuple[Skipped, ...]]:
        """:meth:`resolve`, and for ``latest`` the newer checkpoints it skipped as known to be bad
        (empty for a concrete name: a named checkpoint is served as asked, good or bad)."""
        check_run(run)
        if name == LATEST:
            latest = self.latest(self.listing(run))
            if latest.checkpoint is None:
                if latest.skipped:
                    raise CheckpointNotFound(
                        f"run {run!r} has no visible trainer checkpoint that is not known to be bad: "
                        + "; ".join(f"{s.ref}: {s.reason}" for s in latest.skipped[:3]),
                        ref=f"{run}/latest", skipped=[s.as_json() for s in latest.skipped[:16]])
                raise CheckpointNotFound(f"run {run!r} has no visible trainer checkpoint", ref=f"{run}/latest")
            return latest.checkpoint, latest.skipped
        check_name(name)
        m = self.marker(run, name)
        if m is None:
            raise CheckpointNotFound(f"checkpoint {run}/{name} does not exist or is not committed",
                                     ref=f"{run}/{name}")
        with self._visible(f"{run}/{name}"):
            return self._check(run, name, m), ()


def _says(digest: str, m: Manifest) -> tuple:
    """A verdict: what the manifest of ``digest`` says (see ``Visibility._verdicts``)."""
    return (digest, m.run, m.name, m.session, m.step, m.derived_from, m.parent, m.created_at)


def _disagreement(said: tuple, m: Marker) -> str:
    _, run, name, session, step, derived, parent = said[:7]
    return (f"its manifest says {run}/{name} session {session} step {step} derived from {derived} parent {parent}; "
            f"its COMMITTED marker says {m.ref} session {m.session} step {m.step} derived from {m.derived_from} "
            f"parent {m.parent}")


def _valid(check: Callable[[str], object], value: str) -> bool:
    try:
        check(value)
    except (InvalidName, ValueError):
        return False
    return True
