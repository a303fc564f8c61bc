#!/usr/bin/env python3
"""Checks of growing.py's workloads and report without CuPy: the workloads run on a stand-in
array module that counts the bytes alive, which the workload's own account must match."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import growing  # noqa: E402

MIB = growing.MIB


class FakeXp:
    """An array module whose arrays only know their size; tracks the bytes alive."""

    uint8, float16, float32 = 1, 2, 4

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.allocations = 0
        xp = self

        class Array:
            def __init__(self, shape, itemsize):
                self.shape = shape if isinstance(shape, tuple) else (shape,)
                count = 1
                for n in self.shape:
                    count *= n
                self.nbytes = count * itemsize
                self.itemsize = itemsize
                xp.live += self.nbytes
                xp.peak = max(xp.peak, xp.live)
                xp.allocations += 1

            def __del__(self):
                xp.live -= self.nbytes

            def __setitem__(self, key, value):
                pass

            def fill(self, value):
                pass

        self.Array = Array

    def empty(self, shape, dtype):
        return self.Array(shape, dtype)

    zeros = ones = empty

    def concatenate(self, arrays, axis):
        shape = list(arrays[0].shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        return self.Array(tuple(shape), arrays[0].itemsize)


def run(workload, steps):
    xp = FakeXp()
    account = growing.Account()
    done = []
    growing.WORKLOADS[workload](xp, steps, account, lambda: done.append(xp.live))
    return xp, account, done


def test_the_workloads_account_for_every_byte():
    for workload in growing.WORKLOADS:
        xp, account, done = run(workload, 12)
        assert len(done) == 12, (workload, done)
        assert account.peak == xp.peak, (workload, account.peak, xp.peak)
        assert account.live == 0 and xp.live == 0, (workload, account.live, xp.live)


def test_growing_peaks_at_the_last_copy():
    xp, account, _ = run("growing", 10)
    grow = MIB + 12 * 1024
    last = MIB + 10 * grow
    assert account.peak == last + (last - grow), account.peak


def test_kv_cache_grows_by_one_token_a_step():
    _, _, done = run("kv_cache", 5)
    token = 8 * 16 * 64 * 2
    layers = 8
    # Alive after step s: every layer's key and value of s + 1 tokens.
    assert done == [layers * 2 * (s + 1) * token for s in range(1, 6)], done


def test_the_table():
    results = [
        {"workload": "growing", "pool": "cupy MemoryPool", "steps": 3,
         "peak_requested": 4 * MIB, "peak_reserved": 10 * MIB, "step_ms": 0.5},
        {"workload": "growing", "pool": "rmm pool", "steps": 3,
         "peak_requested": 4 * MIB, "peak_reserved": None, "step_ms": 0.25},
        {"workload": "growing", "pool": "gpualloc default", "error": "rmm not installed"},
    ]
    lines = growing.markdown_table(results).splitlines()
    assert lines[2] == "| growing | cupy MemoryPool | 4.0 MiB | 10.0 MiB | 2.50 | 0.500 |", lines[2]
    assert "| n/a | n/a | 0.250 |" in lines[3], lines[3]
    assert "(rmm not installed)" in lines[4], lines[4]
    assert all(len(line) <= 100 for line in lines), lines


if __name__ == "__main__":
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]
    for name, fn in tests:
        fn()
        print("ok", name)
    print("%d passed, 0 failed" % len(tests))
