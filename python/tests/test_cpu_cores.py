"""CPU test of python/examples/cpu_cores.py over a made-up sysfs topology:

    python3 python/tests/test_cpu_cores.py
"""
import contextlib
import io
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import cpu_cores  # noqa: E402
import compare_workloads as cw  # noqa: E402


def topology(root, cores, threads):
    """A host of `cores` cores in one package, `threads` logical CPUs a core, numbered as
    Linux numbers hyperthreads: CPU k and k + cores are siblings."""
    for t in range(threads):
        for c in range(cores):
            top = os.path.join(root, "cpu%d" % (t * cores + c), "topology")
            os.makedirs(top)
            with open(os.path.join(top, "physical_package_id"), "w") as f:
                f.write("0\n")
            with open(os.path.join(top, "core_id"), "w") as f:
                f.write("%d\n" % c)
    return list(range(cores * threads))


class CoresApartTest(unittest.TestCase):
    def test_siblings_never_land_in_two_lists(self):
        with tempfile.TemporaryDirectory() as root:
            cpus = topology(root, 16, 2)
            lists = cpu_cores.cores_apart(2, 7, allowed=cpus, root=root)
            # CPU 0's core is left to the system; one CPU a core (the first thread), no
            # core in both lists: CPUs 17-23, siblings of 1-7, are in neither
            self.assertEqual(lists, [list(range(1, 8)), list(range(8, 15))])
            cores = [cpu_cores.core_of(c, root) for lst in lists for c in lst]
            self.assertEqual(len(cores), len(set(cores)))

    def test_sixteen_cores_of_two_threads_give_fifteen_at_most(self):
        with tempfile.TemporaryDirectory() as root:
            cpus = topology(root, 16, 2)
            self.assertEqual(cpu_cores.cores_apart(1, 15, allowed=cpus, root=root),
                             [list(range(1, 16))])
            with self.assertRaisesRegex(ValueError, "need 16 physical cores; this host offers 15"):
                cpu_cores.cores_apart(2, 8, allowed=cpus, root=root, skip=1)

    def test_only_the_allowed_cpus_are_used(self):
        with tempfile.TemporaryDirectory() as root:
            topology(root, 8, 2)
            # allowed: only the second thread of cores 2-7 (CPUs 10-15)
            self.assertEqual(cpu_cores.cores_apart(2, 2, allowed=range(10, 16), root=root),
                             [[11, 12], [13, 14]])

    def test_a_host_that_does_not_say_counts_each_cpu_as_a_core(self):
        with tempfile.TemporaryDirectory() as root:
            self.assertEqual(cpu_cores.core_of(3, root), (0, 3))
            self.assertEqual(cpu_cores.cores_apart(2, 1, allowed=[0, 1, 2], root=root),
                             [[1], [2]])

    def test_the_apart_syntax(self):
        self.assertEqual(cpu_cores.parse_apart("apart:8"), cpu_cores.Apart(8))
        self.assertIsNone(cpu_cores.parse_apart("2-9;18-25"))
        for bad in ("apart:0", "apart:x"):
            with self.assertRaises(ValueError):
                cpu_cores.parse_apart(bad)
        self.assertEqual(cw.parse_cpu_lists("apart:4"), cpu_cores.Apart(4))
        self.assertEqual(cpu_cores.format_cpus([2, 3, 9]), "2,3,9")


class ResolveTest(unittest.TestCase):
    def test_a_list_a_run_of_the_round_side_by_side_and_one_otherwise(self):
        self.assertEqual(cw.resolve_cpu_lists([[2], [3]], 2, True), [[2], [3]])
        self.assertEqual(cw.resolve_cpu_lists([[2, 3]], 2, False), [[2, 3]])
        self.assertIsNone(cw.resolve_cpu_lists(None, 2, True))
        with self.assertRaisesRegex(ValueError, "one CPU list a run of the round"):
            cw.resolve_cpu_lists([[2]], 2, True)
        with self.assertRaisesRegex(ValueError, "one CPU list without --side-by-side"):
            cw.resolve_cpu_lists([[2], [3]], 2, False)

    def test_apart_makes_as_many_lists_as_runs_at_once(self):
        real, asked = cpu_cores.cores_apart, []
        cpu_cores.cores_apart = lambda count, per: asked.append((count, per)) or [
            [10 * i + j for j in range(per)] for i in range(count)]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                both = cw.resolve_cpu_lists(cpu_cores.Apart(2), 3, True)
                one = cw.resolve_cpu_lists(cpu_cores.Apart(2), 3, False)
        finally:
            cpu_cores.cores_apart = real
        self.assertEqual(asked, [(3, 2), (1, 2)])
        self.assertEqual(both, [[0, 1], [10, 11], [20, 21]])
        self.assertEqual(one, [[0, 1]])


if __name__ == "__main__":
    unittest.main(verbosity=2)
