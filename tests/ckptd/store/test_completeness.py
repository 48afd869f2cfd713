"""ckptd.store.completeness: which looks one process makes to learn whether a session's indexes are all
stored, and that only a listing ever says they are (pure: the looks are counted callables)."""

from __future__ import annotations

import time

from ckptd.store.completeness import PROBES, Looks


class Store:
    """Rank indexes stored (``stored``) and kept here (``kept``: rank -> "pending" or "stored"), looks counted."""

    def __init__(self, world: int, stored: set[int], kept: dict[int, str] | None = None, window: int = 1) -> None:
        self.world, self.stored, self.kept_here = world, stored, kept or {}
        self.window = window  # ranks one probe answers for (a listing of their window)
        self.probes: list[int] = []
        self.listings = 0

    def missing(self, looks: Looks, since: float | None = None) -> bool:
        return looks.missing_since("s", time.monotonic() if since is None else since, self.world,
                                   self.kept_here.get, self.probe, self.listing)

    def probe(self, r: int) -> tuple[int, ...] | range:
        self.probes.append(r)
        first = r - r % self.window
        return tuple(x for x in range(first, first + self.window) if x in self.stored)

    def listing(self) -> list[int]:
        self.listings += 1
        return sorted(self.stored)


def test_only_a_listing_says_every_index_is_stored():
    store, looks = Store(4, {0, 1, 2}), Looks()
    assert store.missing(looks) and (store.listings, store.probes) == (1, [])  # a first call lists
    store.stored.add(3)
    assert not store.missing(looks) and store.probes == [3] and store.listings == 2  # found, then listed
    looks.forget("s")
    assert not store.missing(looks) and store.listings == 3


def test_a_rank_whose_write_here_is_not_answered_is_missing_without_a_look():
    store, looks = Store(8, {0, 1, 2}), Looks()
    store.missing(looks)  # the listing: 3-7 missing
    store.kept_here.update({3: "stored", 4: "pending"})
    store.stored.add(3)
    probes, listings = len(store.probes), store.listings
    assert store.missing(looks)
    assert (len(store.probes), store.listings) == (probes, listings)  # 3 forgotten as stored here, 4 pending


def test_a_look_begun_after_a_call_s_index_was_stored_answers_it():
    store, looks = Store(8, {0}), Looks()
    before = time.monotonic()
    assert store.missing(looks)  # lists: 1-7 missing
    n = (len(store.probes), store.listings)
    assert store.missing(looks, since=before) and (len(store.probes), store.listings) == n  # no look of its own
    assert store.missing(looks) and len(store.probes) == n[0] + 1  # after that look: one probe, of rank 1


def test_ranks_stored_elsewhere_are_probed_at_most_probes_times_before_a_listing():
    world = 3 * PROBES
    store, looks = Store(world, set()), Looks()
    store.missing(looks)  # every rank missing
    store.stored.update(range(world - 1))  # another replica stored all but the last
    listings = store.listings
    assert store.missing(looks)
    assert len(store.probes) == PROBES and store.listings == listings + 1
    store.probes.clear()
    assert store.missing(looks) and store.probes == [world - 1]  # the listing's gap: one probe


def test_a_probe_answers_for_its_window_and_only_a_listing_says_complete():
    """A probe is a listing of the rank's window: one probe finds every rank of a window stored, one a
    window instead of one a rank; a rank still missing is found missing by its own probe, and only a
    listing says none is."""
    world = 32
    store, looks = Store(world, set(), window=8), Looks()
    store.missing(looks)  # lists: every rank missing
    store.stored.update(range(world - 1))
    assert store.missing(looks)
    assert store.probes == [0, 8, 16, 24, 31] and store.listings == 1  # four windows, then 31: missing
    store.probes.clear()
    store.stored.add(world - 1)
    assert not store.missing(looks) and store.probes == [world - 1] and store.listings == 2
