"""CPU tests of the runner the GPU test scripts share (python/tests/scenarios.py): no torch,
no GPU.  python3 python/tests/test_scenarios.py"""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent('''
    import os, sys
    import scenarios

    def scenario_passes():
        return "fine, " + os.environ.get("EXTRA", "no extra")

    def scenario_raises():
        raise AssertionError("the check failed")

    def scenario_crashes():
        os._exit(3)

    SCENARIOS = {n[len("scenario_"):]: f for n, f in globals().items()
                 if n.startswith("scenario_")}

    def env_for(name):
        return dict(os.environ, EXTRA="extra for " + name) if name == "passes" else None

    if __name__ == "__main__":
        sys.exit(scenarios.main(__file__, SCENARIOS, sys.argv[1:], env_for=env_for, width=9))
''')


class Runner(unittest.TestCase):
    def run_script(self, *names):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "gpu_fake.py")
            with open(script, "w") as f:
                f.write(SCRIPT)
            env = dict(os.environ, PYTHONPATH=HERE)
            return subprocess.run([sys.executable, script, *names], capture_output=True,
                                  text=True, env=env, timeout=120)

    def test_each_scenario_in_its_own_process_with_its_environment(self):
        r = self.run_script("passes")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        lines = r.stdout.splitlines()
        self.assertTrue(lines[0].startswith("PASS  passes    ("), lines)
        self.assertTrue(lines[0].endswith("fine, extra for passes"), lines)
        self.assertEqual(lines[-1], "ALL PASSED")

    def test_failures_and_crashes_are_counted_with_their_reason(self):
        r = self.run_script()
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        out = r.stdout
        self.assertIn("PASS  passes", out)
        self.assertIn("FAIL  raises", out)
        self.assertIn("AssertionError: the check failed", out)
        self.assertIn("FAIL  crashes", out)
        self.assertIn("no output (exit 3)", out)
        self.assertEqual(out.splitlines()[-1], "2 FAILED")


if __name__ == "__main__":
    unittest.main()
