"""SharedRead: one read of the source for several readers, each seeing every item in order."""

from __future__ import annotations

import random
import threading
from typing import Iterator, List

import pytest

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.fae.shared_read import SharedRead


class _Source:
    def __init__(self, n: int, fail_at: int = -1) -> None:
        self.n, self.fail_at, self.calls = n, fail_at, 0

    def __call__(self) -> Iterator[int]:
        self.calls += 1
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"bad item {i}")
            yield i


@pytest.mark.parametrize("seed", range(4))
def test_two_threads_read_everything_in_order_from_one_read(seed: int) -> None:
    source = _Source(300)
    shared = SharedRead(source, consumers=2, bound=400)
    got: List[List[int]] = [[], []]

    def consume(k: int, reader) -> None:
        rng = random.Random(seed * 10 + k)
        for item in reader():
            got[k].append(item)
            if rng.random() < 0.05:
                threading.Event().wait(0.001)

    threads = [threading.Thread(target=consume, args=(k, r)) for k, r in enumerate(shared.readers())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == [list(range(300))] * 2
    assert source.calls == 1 and shared.source_reads == 300 and shared.detached == 0


def test_a_reader_too_far_behind_is_detached_and_still_sees_every_item() -> None:
    source = _Source(50)
    shared = SharedRead(source, consumers=2, bound=8)
    ahead, behind = (r() for r in shared.readers())
    first = [next(behind) for _ in range(3)]
    assert list(ahead) == list(range(50))
    assert shared.detached == 1 and shared.max_kept <= 9
    assert first + list(behind) == list(range(50))
    assert source.calls == 2  # the detached reader read on its own from item 3


def test_items_are_forgotten_once_every_reader_passed_them_and_a_closed_reader_holds_nothing() -> None:
    shared = SharedRead(_Source(100), consumers=2, bound=1000)
    a, b = (r() for r in shared.readers())
    for _ in range(10):
        next(a), next(b)
    assert shared.max_kept == 1
    b.close()
    assert list(a) == list(range(10, 100)) and shared.max_kept == 1


def test_an_error_of_the_source_reaches_every_reader_where_its_item_was() -> None:
    shared = SharedRead(_Source(10, fail_at=4), consumers=2)
    for reader in shared.readers():
        got = []
        with pytest.raises(ValueError, match="bad item 4"):
            for item in reader():
                got.append(item)
        assert got == [0, 1, 2, 3]


def test_bad_arguments_and_a_reader_used_twice_are_refused() -> None:
    with pytest.raises(ConfigError, match="consumer"):
        SharedRead(_Source(1), consumers=0)
    with pytest.raises(ConfigError, match="bound"):
        SharedRead(_Source(1), bound=0)
    reader = SharedRead(_Source(3), consumers=1).readers()[0]
    assert list(reader()) == [0, 1, 2]
    with pytest.raises(ConfigError, match="twice"):
        next(reader())
