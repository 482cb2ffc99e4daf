"""The page allocator: lowest ids first, reference counts, null page, no double frees."""

from __future__ import annotations

import random

import pytest

from pd_cluster.engine.kv.allocator import NULL_PAGE, OutOfPagesError, PageAllocator


def test_allocates_lowest_ids_first_and_never_the_null_page():
    a = PageAllocator(8)
    assert a.allocate(3) == [1, 2, 3]
    a.free([2])
    assert a.allocate(2) == [2, 4]
    assert NULL_PAGE not in a.allocate(4)
    assert a.num_free == 0


def test_out_of_pages_takes_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfPagesError) as err:
        a.allocate(2)
    assert (err.value.requested, err.value.free, err.value.total) == (2, 1, 4)
    assert a.num_free == 1


def test_refcounts_share_and_release():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.incref(pages)
    a.free(pages)
    assert a.num_free == 2 and a.refcount(pages[0]) == 1
    a.free(pages)
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.free(pages)  # double free
    with pytest.raises(ValueError):
        a.incref([1])  # not in use
    with pytest.raises(ValueError):
        a.free([NULL_PAGE])


def test_random_churn_conserves_pages():
    rng = random.Random(0)
    a = PageAllocator(100)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or a.num_free < 10):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(a.allocate(rng.randint(1, 10)))
        assert a.num_free + sum(map(len, held)) == 100
        assert len({p for h in held for p in h}) == sum(map(len, held))
    for h in held:
        a.free(h)
    assert a.num_free == 100
