#!/usr/bin/env python3
"""CPU test of capture_traces.py's snapshot-to-text conversion (no torch):

    python3 scripts/capture/test_capture_traces.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import capture_traces  # noqa: E402


def ev(action, addr, size=512, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


class ConvertTest(unittest.TestCase):
    def test_a_free_completed_later_becomes_a_c_line(self):
        entries = [
            ev("alloc", 0x100), ev("alloc", 0x400, stream=7),
            # Freed at once: nothing more.
            ev("free_requested", 0x100), ev("free_completed", 0x100),
            # Used on another stream: its completion comes after an allocation.
            ev("free_requested", 0x400, stream=7), ev("alloc", 0x800),
            ev("free_completed", 0x400, stream=7),
        ]
        lines, info = capture_traces.convert_trace(entries, "# workload t")
        self.assertEqual(lines, ["# workload t", "a 0 512 0", "a 1 512 1", "f 0 0", "f 1 1",
                                 "a 2 512 0", "c 1"])
        self.assertEqual(info["deferred_frees"], 1)


if __name__ == "__main__":
    unittest.main()
