#!/usr/bin/env python3
"""Checks of page_moves.py on small hand-made placements and traces."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_moves as pm  # noqa: E402

MIB = pm.MIB


def a(addr_mib, size_mib):
    return (True, addr_mib * MIB, size_mib * MIB, size_mib * MIB)


def f(addr_mib, size_mib):
    return (False, addr_mib * MIB, size_mib * MIB, 0)


def test_a_hole_smaller_than_a_page_stays_mapped():
    # Two 10 MiB blocks side by side in 16 MiB pages, the first freed, then a
    # 12 MiB block beyond them: 2 MiB pages unmap most of the hole for it, one
    # 16 MiB page (shared with the live block) cannot.
    events = [a(0, 10), a(10, 10), f(0, 10), a(32, 12)]
    peak2, unmapped2 = pm.rounds(events, "uniform", 2 * MIB)
    peak16, unmapped16 = pm.rounds(events, "uniform", 16 * MIB)
    assert (peak2, unmapped2) == (22 * MIB, 5), (peak2, unmapped2)
    assert (peak16, unmapped16) == (48 * MIB, 0), (peak16, unmapped16)


def test_mixed_pages_use_one_big_page_where_a_block_covers_it():
    # A 40 MiB block at 0 covers two aligned 16 MiB pages and 8 MiB more.
    events = [a(0, 40), f(0, 40), a(64, 4)]
    peak, unmapped = pm.rounds(events, "mixed", 16 * MIB)
    assert peak == 40 * MIB
    # Two big pages and four 2 MiB granules (32..40 MiB); the 4 MiB block
    # needs 4 MiB back: the two highest granules go, not a big page.
    assert unmapped == 2, unmapped


def test_zoned_pages_grow_with_the_offset():
    g = lambda offset: (pm.ZONE_ALIGN + offset) // pm.GRANULE  # noqa: E731
    assert pm.zoned_granules(g(0), 512, 8) == 1
    assert pm.zoned_granules(g((2 << 30) - MIB), 512, 8) == 1
    assert pm.zoned_granules(g(2 << 30), 512, 8) == 2  # 4 MiB from 2 GiB
    assert pm.zoned_granules(g(5 << 30), 512, 8) == 4  # 8 MiB from 4 GiB
    assert pm.zoned_granules(g(40 << 30), 512, 8) == 8  # 16 MiB at most
    # Below 2 GiB zoned pages are the 2 MiB of uniform:2.
    events = [a(0, 10), a(10, 10), f(0, 10), a(32, 12)]
    assert pm.rounds(events, "zoned", 16 * MIB) == pm.rounds(events, "uniform", 2 * MIB)


def test_beladys_choice_never_moves_more():
    # Three 2 MiB pages in turn with room for two: page 0 comes back, 2 not.
    events = [a(0, 2), f(0, 2), a(2, 2), f(2, 2), a(4, 2), f(4, 2), a(0, 2), f(0, 2),
              a(2, 2), f(2, 2)]
    results = {rule: pm.choice(events, 2 * MIB, rule)[1]
               for rule in ("highest", "oldest-freed", "belady")}
    assert results["belady"] <= min(results.values()), results
    assert pm.choice(events, 2 * MIB, "belady")[0] == 2 * MIB


def test_pack_reuses_space_of_blocks_that_died():
    # 1 MiB lives throughout; two 3 MiB blocks one after the other share an
    # offset: span 4 MiB, the peak of live bytes.
    trace = [("a", "1", MIB), ("a", "2", 3 * MIB), ("f", "2", 0),
             ("a", "3", 3 * MIB), ("f", "3", 0)]
    assert pm.pack(trace) == (4 * MIB, 4 * MIB)


def test_place_carves_from_the_front_or_the_back():
    trace = [("a", "1", 20 * MIB), ("f", "1", 0), ("a", "2", 8 * MIB)]
    for variant, want in (("best", 1 << 44), ("back", (1 << 44) + 24 * MIB)):
        with tempfile.NamedTemporaryFile("w+", delete=False) as out:
            pm.place(trace, variant, 2 * MIB, out)
        events = pm.read_placements(out.name)
        os.unlink(out.name)
        assert events[2][1] == want, (variant, events)


if __name__ == "__main__":
    for name, test in list(globals().items()):
        if name.startswith("test_"):
            test()
    print("page_moves: all tests passed")
