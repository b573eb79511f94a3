from __future__ import annotations

import pytest

from orchestra.familycache import Entry, EntryPool, Namespace

EXACT = Namespace("exact", "m1", "float32", '{"theta":1e4}')
MAPPED = Namespace("mapped", "m1", "float32", '{"theta":1e4}', source_fingerprint="m0", mapping_id="w1",
                   mapping_version=1, variant="tail=32")


def _entry(tokens, nbytes=100, ns=EXACT) -> Entry:
    return Entry(ns, "m", tuple(tokens), cache=object(), nbytes=nbytes)


def test_namespaces_validate():
    with pytest.raises(ValueError, match="needs source_fingerprint"):
        Namespace("mapped", "m1", "float32", "{}")
    with pytest.raises(ValueError, match="cannot name a mapping"):
        Namespace("exact", "m1", "float32", "{}", mapping_id="w")


def test_longest_prefix_by_block_then_token():
    pool = EntryPool(10_000, block_tokens=4)
    doc = list(range(100, 140))
    long = _entry(doc + [1, 2, 3])
    pool.add(long, pin=False)
    entry, n = pool.longest_prefix(EXACT, doc + [9, 9])
    assert entry is long and n == 40
    entry, n = pool.longest_prefix(EXACT, doc[:13] + [7])  # diverges inside a block: token-wise
    assert entry is long and n == 13
    entry, n = pool.longest_prefix(EXACT, [100, 101])  # shorter than a block
    assert entry is long and n == 2
    assert pool.longest_prefix(EXACT, [5, 6, 7, 8, 9]) == (None, 0)


def test_exact_and_mapped_never_mix():
    pool = EntryPool(10_000, block_tokens=4)
    pool.add(_entry(range(20), ns=MAPPED), pin=False)
    assert pool.longest_prefix(EXACT, list(range(20))) == (None, 0)
    assert pool.longest_prefix(MAPPED, list(range(20)))[1] == 20


def test_budget_evicts_lru_but_never_pinned():
    pool = EntryPool(300, block_tokens=4)
    a, b, c = _entry(range(0, 8)), _entry(range(10, 18)), _entry(range(20, 28))
    pool.add(a, pin=True)
    pool.add(b, pin=False)
    pool.add(c, pin=False)
    assert pool.used_bytes == 300
    d = _entry(range(30, 38))
    evicted = pool.add(d, pin=False)
    assert evicted == [b] and a.stored and not b.stored and pool.used_bytes == 300
    big = _entry(range(40, 48), nbytes=250)
    pool.add(big, pin=False)  # only a (pinned, 100) may stay: 100 + 250 > 300 -> refused
    assert not big.stored and pool.stats.rejected == 1
    pool.unpin(a)
    pool.add(big, pin=False)
    assert big.stored and pool.used_bytes <= 300
    assert pool.stats.evictions >= 2


def test_reservations_share_the_budget_with_entries_evicting_unpinned_ones_first():
    pool = EntryPool(300, block_tokens=4)
    pinned, loose = _entry(range(0, 8)), _entry(range(10, 18))
    pool.add(pinned, pin=True)
    pool.add(loose, pin=False)
    assert pool.reserve(150)  # evicts the unpinned entry to make room
    assert not loose.stored and pinned.stored and pool.reserved_bytes == 150
    assert not pool.reserve(100) and pool.stats.reservations_refused == 1  # 100 pinned + 150 + 100 > 300
    late = _entry(range(20, 28))
    pool.add(late, pin=False)  # entries see the reservation too: 100 + 150 + 100 > 300
    assert not late.stored
    pool.release(150)
    assert pool.reserved_bytes == 0 and pool.reserve(200) and pool.stats.reserved_bytes == 200


def test_an_unpin_over_a_budget_shrunk_by_reservations_evicts():
    pool = EntryPool(300, block_tokens=4)
    a, b = _entry(range(0, 8)), _entry(range(10, 18))
    pool.add(a, pin=True)
    pool.add(b, pin=True)
    assert pool.reserve(100)
    assert not pool.reserve(1)
    pool.unpin(b)
    assert b.stored  # within the budget: 200 + 100
    pool.release(100)
    assert pool.reserve(150)  # evicts b, now unpinned
    assert not b.stored and a.stored


def test_an_entry_that_did_not_fit_counts_against_the_budget_while_a_lease_holds_it():
    pool = EntryPool(300, block_tokens=4)
    a = _entry(range(0, 8), nbytes=200)
    pool.add(a, pin=True)
    big = _entry(range(10, 18), nbytes=150)
    pool.add(big, pin=True)  # no room beside the pinned 200: not stored, but held by its lease
    assert not big.stored and pool.outside_bytes == 150
    assert not pool.reserve(1)  # 200 stored + 150 held outside > 300
    pool.unpin(big)
    assert pool.outside_bytes == 0 and pool.reserve(100)


def test_a_build_in_progress_holds_budget_that_reservations_cannot_take():
    pool = EntryPool(300, block_tokens=4)
    loose = _entry(range(8), nbytes=100)
    pool.add(loose, pin=False)
    pool.hold(250)  # a cache being built: its bytes are memory already, fitting or not
    assert not loose.stored and pool.reserved_bytes == 250  # the unpinned entry made room for it
    assert not pool.reserve(100)  # a decoding row waits while the build runs
    built = _entry(range(20, 40), nbytes=250)
    pool.add(built, pin=True, held=250)  # the hold becomes the entry in one step
    assert built.stored and pool.reserved_bytes == 0 and pool.used_bytes == 250
    assert pool.reserve(50) and not pool.reserve(1)


def test_a_hold_is_counted_even_when_pinned_entries_leave_no_room():
    pool = EntryPool(200, block_tokens=4)
    pool.add(_entry(range(8), nbytes=150), pin=True)
    pool.hold(100)
    assert pool.reserved_bytes == 100 and not pool.reserve(1)
    pool.release(100)
    assert pool.reserve(50)


def test_whoever_waits_for_room_hears_of_every_release_unpin_and_finished_build():
    pool = EntryPool(300, block_tokens=4)
    heard: list[int] = []
    pool.on_free(lambda: heard.append(pool.reserved_bytes))
    pinned = _entry(range(8), nbytes=100)
    pool.add(pinned, pin=True)
    assert pool.reserve(100) and heard == []  # taking budget frees nothing
    pool.release(100)
    assert heard == [0]
    pool.hold(150)
    pool.add(_entry(range(20, 40), nbytes=60), pin=True, held=150)  # a build's working memory comes free
    assert heard == [0, 0]
    pool.unpin(pinned)
    assert heard == [0, 0, 0] and pool.reserve(200)  # the unpinned entry is evicted for the reservation
