"""ckptd.cli.readahead: ranges fetched ahead of sequential reads, and nothing wrong or unbounded
whatever the reads do."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.cli.readahead import ReadAhead

FILES = {"a.bin": bytes(range(256)) * 40, "b.bin": bytes(reversed(range(256))) * 7}


class Recorder:
    """A fetch over in-memory files that records each call; ``gate`` holds fetches back until set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def __call__(self, file: str, start: int, end: int) -> bytes:
        self.gate.wait(10)
        with self.lock:
            self.calls.append((file, start, end))
        return FILES[file][start:end]


def sizes() -> dict[str, int]:
    return {k: len(v) for k, v in FILES.items()}


def test_sequential_reads_are_fetched_ahead_once():
    fetch = Recorder()
    ahead = ReadAhead(fetch, sizes(), depth=3)
    n, size = 1000, len(FILES["a.bin"])
    got = b"".join(ahead.read("a.bin", s, min(s + n, size)) for s in range(0, size, n))
    ahead.close()
    assert got == FILES["a.bin"]
    # every range fetched exactly once (the reads took the fetched-ahead ranges), none past the end
    assert sorted(fetch.calls) == [("a.bin", s, min(s + n, size)) for s in range(0, size, n)]


def in_flight(ahead: ReadAhead) -> int:
    """Prefetched ranges not taken yet (done or not)."""
    with ahead._lock:
        return len(ahead._pending)


def test_the_next_ranges_are_in_flight_before_they_are_asked_for():
    fetch = Recorder()
    ahead = ReadAhead(fetch, sizes(), depth=2)
    assert ahead.read("a.bin", 0, 100) == FILES["a.bin"][:100]
    assert in_flight(ahead) == 2  # [100, 200) and [200, 300)
    ahead.close()
    assert in_flight(ahead) == 0


def test_a_read_elsewhere_fetches_only_itself_and_drops_what_it_passed():
    fetch = Recorder()
    ahead = ReadAhead(fetch, sizes(), depth=3)
    ahead.read("a.bin", 0, 100)            # sequential from 0: 3 ranges ahead
    assert in_flight(ahead) == 3
    ahead.read("a.bin", 5000, 5100)        # a jump: the ranges behind it are dropped, none fetched ahead
    assert in_flight(ahead) == 0
    ahead.read("a.bin", 5100, 5150)        # sequential again, with its own length
    assert in_flight(ahead) == 3
    ahead.read("a.bin", 5150, 5170)        # a shorter length: the run ahead is redone, not added to
    assert in_flight(ahead) == 3
    ahead.close()


def test_a_failed_fetch_raises_in_the_read_that_takes_it():
    def fetch(file: str, start: int, end: int) -> bytes:
        if start >= 200:
            raise OSError(f"{file}: cannot read at {start}")
        return FILES[file][start:end]

    ahead = ReadAhead(fetch, sizes(), depth=2)
    ahead.read("a.bin", 0, 100)
    ahead.read("a.bin", 100, 200)
    with pytest.raises(OSError, match="a.bin: cannot read at 200"):
        ahead.read("a.bin", 200, 300)
    ahead.close()


# each read continues its file's previous read (start None) or jumps to a start; lengths vary
reads = st.lists(st.tuples(st.sampled_from(sorted(FILES)), st.none() | st.integers(0, 11000),
                           st.integers(0, 1500)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(reads=reads, depth=st.integers(0, 4))
def test_any_reads_get_their_bytes_and_hold_a_bounded_number_of_ranges(reads, depth):
    ahead = ReadAhead(Recorder(), sizes(), depth=depth, workers=2)
    last = dict.fromkeys(FILES, 0)
    try:
        for file, start, length in reads:
            start = min(last[file] if start is None else start, len(FILES[file]))
            end = last[file] = min(start + length, len(FILES[file]))
            assert ahead.read(file, start, end) == FILES[file][start:end]
            assert in_flight(ahead) <= depth * len(FILES)
    finally:
        ahead.close()
