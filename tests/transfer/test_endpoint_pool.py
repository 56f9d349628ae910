"""SIEVE eviction order against a hand-worked sequence, and the pool around it."""

from __future__ import annotations

from pymooncake.transfer.endpoint_pool import EndpointPool, SieveCache


def test_sieve_hand_worked_sequence() -> None:
    # capacity 3. Trace (head = newest first):
    # insert A,B,C          -> [C B A], hand none
    # access A, access B    -> A*, B*
    # insert D: hand starts at tail A*: clear A, move to B*: clear B, move to C: evict C;
    #                           hand rests on C's newer neighbour = none -> next time tail.
    #                       -> [D B A]
    # access D              -> D*
    # insert E: hand at tail A (bit cleared before) -> evict A; hand -> B
    #                       -> [E D B]
    # insert F: hand at B (clear) -> evict B; hand -> D*
    #                       -> [F E D]
    # insert G: hand at D*: clear, move to newer E: clear bit -> evict E; hand -> F
    #                       -> [G F D]
    c: SieveCache[str] = SieveCache(3)
    assert [c.insert(k) for k in "ABC"] == [None, None, None]
    assert c.access("A") and c.access("B")
    assert c.insert("D") == "C"
    assert c.keys_newest_first() == ["D", "B", "A"]
    assert c.access("D")
    assert c.insert("E") == "A"
    assert c.insert("F") == "B"
    assert c.keys_newest_first() == ["F", "E", "D"]
    assert c.insert("G") == "E"
    assert c.keys_newest_first() == ["G", "F", "D"]
    assert not c.access("C")


def test_sieve_all_visited_evicts_the_oldest_after_one_sweep() -> None:
    c: SieveCache[int] = SieveCache(2)
    c.insert(1)
    c.insert(2)
    c.access(1)
    c.access(2)
    assert c.insert(3) == 1  # sweep clears 1 and 2, wraps to the tail (1)
    assert c.keys_newest_first() == [3, 2]


def test_pool_opens_on_first_use_reuses_and_closes_evicted() -> None:
    closed: list[str] = []
    pool: EndpointPool[str, str] = EndpointPool(2, closed.append)
    opened: list[str] = []

    def opener(name: str):  # noqa: ANN202
        def f() -> str:
            opened.append(name)
            return f"ep-{name}"
        return f

    ep, reused = pool.acquire("a", opener("a"))
    assert (ep, reused) == ("ep-a", False)
    pool.release("a", ep)
    ep, reused = pool.acquire("a", opener("a"))
    assert (ep, reused) == ("ep-a", True)  # hit: marks a visited
    pool.release("a", ep)
    for k in ("b", "c"):  # c evicts b (a is visited)
        ep, _ = pool.acquire(k, opener(k))
        pool.release(k, ep)
    assert opened == ["a", "b", "c"]
    assert closed == ["ep-b"]
    assert pool.num_evictions == 1
    # An endpoint evicted while in use is closed on release, not under its user.
    ep_a, _ = pool.acquire("a", opener("a"))
    ep_d, _ = pool.acquire("d", opener("d"))  # evicts c (hand at c? a was cleared earlier)
    assert closed == ["ep-b", "ep-c"]
    pool.release("d", ep_d)
    pool.discard("a", ep_a)
    assert closed[-1] == "ep-a" and len(pool) == 1
