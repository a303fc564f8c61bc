"""The runner the GPU test scripts share: each scenario in a process of its own (a crash
or a leaked CUDA state stays in it), a PASS or FAIL line per scenario with the line it
returned, and an exit status that counts the failures.

A script calls ``scenarios.main(__file__, SCENARIOS, sys.argv[1:])``: with no names it
runs every scenario, with names those; ``--child NAME`` is the child's own call."""
import subprocess
import sys
import time


def run(script, scenarios, names, env_for=lambda name: None, width=22):
    """Runs ``names`` (all of ``scenarios`` when empty), each as ``script --child NAME``
    with the environment ``env_for(name)`` (None: this process's); returns 1 if any
    failed, else 0."""
    failed = 0
    for name in names or scenarios:
        t = time.time()
        r = subprocess.run([sys.executable, "-X", "faulthandler", script, "--child", name],
                           capture_output=True, text=True, timeout=600, env=env_for(name))
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        ok = r.returncode == 0 and lines
        detail = lines[-1][7:] if lines else (
            r.stderr.strip().splitlines() or ["no output (exit %d)" % r.returncode])[-1]
        print("%s  %-*s (%.1f s) %s" % ("PASS" if ok else "FAIL", width, name,
                                        time.time() - t, detail), flush=True)
        if not ok:
            failed += 1
            sys.stdout.write(r.stdout[-3000:] + r.stderr[-3000:] + "\n")
    print("ALL PASSED" if not failed else "%d FAILED" % failed)
    return 1 if failed else 0


def main(script, scenarios, argv, env_for=lambda name: None, width=22):
    """The script's entry point: a child runs its one scenario and prints its line; the
    parent runs the scenarios named in ``argv`` (all when none) and returns the status."""
    if len(argv) > 1 and argv[0] == "--child":
        print("RESULT " + scenarios[argv[1]]())
        return 0
    return run(script, scenarios, argv, env_for, width)
