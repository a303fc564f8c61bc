#!/usr/bin/env python3
"""PyTorch's own allocator tests, run under PyTorch's allocator and under gpualloc, with the
outcomes side by side.

    python3 scripts/pytorch_tests/run.py --tests DIR --out OUTDIR [options]

DIR holds PyTorch's test files test_cuda.py and test_multiprocessing.py, copied from
test/ of PyTorch's source at the installed release (they are part of neither the torch
wheel nor this repository; the repository ignores the folder .pytorch-tests for them); the
lines 'FILE: where it came from' of DIR/SOURCE.txt, if any, go into the report. Their
helpers come from the installed torch (torch.testing._internal).

For each chunk of selected tests (selection.py) and each mode, a test process (child.py)
runs the chunk's tests one by one and records each outcome as it ends; modes alternate
chunk by chunk, so a run cut short by its time budget still compares the chunks it
reached. Modes:

    pytorch              PyTorch's CUDACachingAllocator
    gpualloc             gpu_alloc.enable() before CUDA initialises (sitecustomize), in the
                         test process and in every Python process its tests start;
                         $GPUALLOC_CONF from --gpualloc-conf (default: unset)
    pytorch-expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    gpualloc-expandable  GPUALLOC_CONF=expandable_segments:True, and the same
                         PYTORCH_CUDA_ALLOC_CONF so that the tests expect expandable segments

A test that crashes its process is recorded as crashed (with the end of the process's
output) and the chunk goes on in a new process from the next test; a test running past
--test-timeout is killed and recorded as timeout; when --max-seconds runs out, the test
running is recorded as interrupted and the rest as not-run.

Written to OUTDIR: report.md (the comparison), results.json (every outcome, with messages
and tracebacks), logs.tar.gz (each test process's output, the end of it when long).

The gpualloc library is $GPUALLOC_SO, else target/release/liballoc_ffi.so; gpu_alloc comes
from python/ of this repository. The C++ bridge is built once, before the tests, into
$TORCH_EXTENSIONS_DIR (default: a folder under --work shared by all modes, which also keeps
the extensions that the tests themselves build; its lock files are removed before each
test process, as no other process may build there meanwhile). Pure-Python wheels in DIR/wheels are put
on the path of the test processes when the module they provide is missing (PyTorch's test
helpers import expecttest, which the torch wheel does not require). No pytest is needed.
"""
import argparse
import datetime
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import events  # noqa: E402
import report  # noqa: E402
import selection  # noqa: E402

MODES = {
    "pytorch": {"gpualloc": False, "env": {},
                "description": "PyTorch's own CUDA caching allocator"},
    "pytorch-expandable": {"gpualloc": False,
                           "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                           "description": "PyTorch's allocator with expandable segments"},
    "gpualloc": {"gpualloc": True, "env": {},
                 "description": "gpualloc (gpu_alloc.enable() before CUDA initialises, "
                                "C++ bridge)"},
    "gpualloc-expandable": {"gpualloc": True,
                            "env": {"GPUALLOC_CONF": "expandable_segments:True",
                                    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                            "description": "gpualloc with expandable segments"},
}
CLEARED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GPUALLOC_CONF",
               "GPUALLOC_TESTS_ENABLE", "GPUALLOC_TESTS_LOG")
# Modules PyTorch's test helpers import that the torch wheel does not require.
NEEDED_MODULES = ("expecttest", "numpy", "psutil")
LOG_TAIL_LINES = 40
MAX_LOG_BYTES = 256 * 1024
MAX_RESTARTS = 12


def now():
    return time.monotonic()


class Runner:
    def __init__(self, args):
        self.args = args
        self.t0 = now()
        self.deadline = self.t0 + args.max_seconds
        self.tests_dir = os.path.abspath(args.tests)
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(args.work)
        self.logs = os.path.join(self.work, "logs")
        self.notes = []
        self.chunks_info = []
        self.modes = {}
        self.base_env = self.make_base_env()

    # ---- setup -------------------------------------------------------------------------

    def say(self, text):
        print("[%5.0fs] %s" % (now() - self.t0, text), flush=True)

    def make_base_env(self):
        env = dict(os.environ)
        for k in CLEARED_ENV:
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTORCH_DISABLE_RUNNING_SCRIPT_CHK"] = "1"
        if self.args.slow:
            env["PYTORCH_TEST_WITH_SLOW"] = "1"
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(self.work, "torch_extensions"))
        so = env.pop("GPUALLOC_SO", None) or os.path.join(
            REPO, "target", "release", "liballoc_ffi.so")
        self.library = os.path.abspath(so)
        if os.path.isfile(so):
            env["GPUALLOC_SO"] = self.library
        paths = [os.path.join(REPO, "python"), self.tests_dir]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def add_missing_modules(self):
        """Puts DIR/wheels/*.whl (pure Python) on the path for modules the interpreter lacks."""
        probe = ("import importlib.util,sys; print(' '.join(m for m in sys.argv[1:] "
                 "if importlib.util.find_spec(m) is None))")
        r = subprocess.run([self.args.python, "-c", probe] + list(NEEDED_MODULES),
                           env=self.base_env, capture_output=True, text=True)
        missing = r.stdout.split()
        if not missing:
            return
        wheels_dir = os.path.join(self.tests_dir, "wheels")
        found = []
        for name in missing:
            whl = None
            if os.path.isdir(wheels_dir):
                for f in sorted(os.listdir(wheels_dir)):
                    if f.lower().startswith(name.lower() + "-") and f.endswith(
                            "-py3-none-any.whl"):
                        whl = os.path.join(wheels_dir, f)
            if whl is None:
                self.notes.append("module %s is missing and no pure-Python wheel for it is in "
                                  "%s: tests that need it fail to import" % (name, wheels_dir))
                continue
            # A pure-Python wheel is a zip that zipimport can read; unpack it anyway so that
            # tools reading __file__ work.
            dest = os.path.join(self.work, "site-packages")
            with zipfile.ZipFile(whl) as z:
                z.extractall(dest)
            found.append(os.path.basename(whl))
            if dest not in self.base_env["PYTHONPATH"].split(os.pathsep):
                self.base_env["PYTHONPATH"] += os.pathsep + dest
        if found:
            self.notes.append("missing module(s) taken from wheels: %s" % ", ".join(found))

    def mode_env(self, mode):
        spec = MODES[mode]
        env = dict(self.base_env)
        env.update(spec["env"])
        if spec["gpualloc"]:
            if mode == "gpualloc" and self.args.gpualloc_conf:
                env["GPUALLOC_CONF"] = self.args.gpualloc_conf
            env["GPUALLOC_TESTS_ENABLE"] = "1"
            env["GPUALLOC_TESTS_LOG"] = os.path.join(self.work, "%s-enable-failures.log" % mode)
            env["PYTHONPATH"] = os.path.join(HERE, "site") + os.pathsep + env["PYTHONPATH"]
        return env

    def build_bridge(self):
        """Builds the C++ bridge once, so that no test process pays for it (or races)."""
        script = ("import gpu_alloc, torch; gpu_alloc.load_library(); gpu_alloc.build_bridge(); "
                  "print('gpualloc', gpu_alloc.version(), gpu_alloc.library_path())")
        t = now()
        self.clear_extension_locks()
        try:
            r = subprocess.run([self.args.python, "-c", script], env=self.base_env,
                               capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return "building the C++ bridge took more than 600 s"
        if r.returncode != 0:
            text = (r.stdout + r.stderr).strip()
            return "building the C++ bridge failed: " + text[-3000:]
        self.say("bridge ready in %.0f s: %s" % (now() - t, r.stdout.strip()))
        return None

    def clear_extension_locks(self):
        """Removes the lock files of torch's extension builds. A process killed while it held
        one (a test past its timeout, or one of its subprocesses) would make every later
        `cpp_extension.load` of that extension, the bridge's included, wait for ever; no
        process of this run is running when this is called."""
        root = self.base_env["TORCH_EXTENSIONS_DIR"]
        if not os.path.isdir(root):
            return
        for dirpath, _, files in os.walk(root):
            if "lock" in files:
                try:
                    os.unlink(os.path.join(dirpath, "lock"))
                except OSError:
                    pass

    # ---- one chunk in one mode ---------------------------------------------------------

    def run_chunk(self, chunk, mode):
        """Runs a chunk's tests in `mode`, in as many processes as crashes require."""
        spec = MODES[mode]
        env = self.mode_env(mode)
        cwd = os.path.join(self.work, mode, "cwd")
        os.makedirs(cwd, exist_ok=True)
        info = {"name": chunk["name"], "mode": mode, "attempts": 0, "notes": []}
        results = {}
        planned = None  # ids still to run on a restart; None: the child selects
        t_start = now()
        while True:
            info["attempts"] += 1
            n = info["attempts"]
            stem = "%s-%s-%d" % (mode, chunk["name"], n)
            events_path = os.path.join(self.work, mode, stem + ".jsonl")
            log_path = os.path.join(self.logs, stem + ".log")
            cmd = [self.args.python, os.path.join(HERE, "child.py"), "--tests", self.tests_dir,
                   "--file", chunk["file"], "--results", events_path]
            if planned is None:
                cmd += ["--chunk-json", json.dumps(chunk)]
                for k in self.args.keywords:
                    cmd += ["-k", k]
                if self.args.all:
                    cmd.append("--all")
            else:
                ids_path = os.path.join(self.work, mode, stem + ".ids")
                with open(ids_path, "w", encoding="utf-8") as f:
                    f.write("\n".join(planned) + "\n")
                cmd += ["--ids-file", ids_path]
            if spec["gpualloc"]:
                cmd.append("--expect-gpualloc")
            self.clear_extension_locks()
            end_reason, rc = self.watch(cmd, env, cwd, events_path, log_path)
            if end_reason is None and rc not in (0, None):
                end_reason = describe_exit(rc)
            attempt = events.Attempt(events.load_events(events_path))
            if attempt.env and not self.modes[mode].get("env"):
                self.modes[mode]["env"] = {k: v for k, v in attempt.env.items()
                                           if k not in ("event", "time")}
                for name in attempt.env.get("compat") or []:
                    note = ("%s was missing from the installed torch's test helpers; defined "
                            "as the test files of torch 2.11 define it" % name)
                    if note not in self.notes:
                        self.notes.append(note)
            tail = log_tail(log_path)
            decided, remaining = events.settle(attempt, planned, end_reason, tail)
            if attempt.plan is None and planned is None and not decided:
                # Died before choosing its tests: one pseudo-test says so.
                why = (attempt.fatal or {}).get("message") or (
                    "its process ended before selecting tests (%s): %s"
                    % (end_reason or "exit", last_line(tail)))
                decided = {collection_id(chunk): events.result("error", why, tail)}
            results.update(decided)
            crashed = [t for t, r in decided.items() if r["outcome"] in ("crashed", "timeout")]
            if crashed:
                info["notes"].append("%s %s" % (decided[crashed[0]]["outcome"],
                                                report.short_id(crashed[0])))
            if not remaining:
                break
            if info["attempts"] > MAX_RESTARTS:
                for tid in remaining:
                    results[tid] = events.result("error", "not run: the chunk's processes "
                                                 "crashed %d times" % info["attempts"])
                info["notes"].append("gave up after %d processes" % info["attempts"])
                break
            if now() >= self.deadline:
                for tid in remaining:
                    results[tid] = events.result("not-run", "the run's time budget ran out")
                break
            planned = remaining
        info["seconds"] = round(now() - t_start, 1)
        info["tests"] = len(results)
        self.chunks_info.append(info)
        self.modes[mode]["tests"].update(results)
        c = {}
        for r in results.values():
            c[r["outcome"]] = c.get(r["outcome"], 0) + 1
        self.say("%-20s %-9s %3d tests in %5.1f s, %d process(es): %s" % (
            mode, chunk["name"], len(results), info["seconds"], info["attempts"],
            ", ".join("%d %s" % (v, k) for k, v in sorted(c.items()))))

    def watch(self, cmd, env, cwd, events_path, log_path):
        """Runs one test process; returns (None, exit status) if it exited by itself, else
        (why it was killed: 'timeout', 'budget' or 'stalled', None)."""
        os.makedirs(os.path.dirname(events_path), exist_ok=True)
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        if os.path.exists(events_path):
            os.unlink(events_path)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        reason = None
        offset = 0
        current = None
        last_progress = now()
        buf = ""
        while True:
            rc = proc.poll()
            # Read what the child wrote since the last look.
            try:
                with open(events_path, encoding="utf-8", errors="replace") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
            except FileNotFoundError:
                chunk = ""
            buf += chunk
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                kind = ev.get("event")
                if kind == "start":
                    current = (ev.get("id"), now())
                    last_progress = now()
                elif kind in ("end", "plan", "env", "boot"):
                    if kind == "end":
                        current = None
                    last_progress = now()
                elif kind == "done":
                    current = None
                    last_progress = now()
            if rc is not None:
                break
            t = now()
            if t >= self.deadline:
                reason = "budget"
            elif current is not None and t - current[1] > self.args.test_timeout:
                reason = "timeout"
            elif current is None and t - last_progress > self.args.stall_timeout:
                reason = "stalled"
            if reason:
                kill_group(proc)
                proc.wait()
                rc = None
                break
            time.sleep(0.2)
        # Whatever the tests left running in the process group goes too.
        kill_group(proc)
        return reason, rc

    # ---- the whole run -----------------------------------------------------------------

    def run(self):
        args = self.args
        os.makedirs(self.out, exist_ok=True)
        if os.path.isdir(self.work) and not args.keep_work:
            for name in os.listdir(self.work):
                if name not in ("torch_extensions",):
                    shutil.rmtree(os.path.join(self.work, name), ignore_errors=True)
        os.makedirs(self.logs, exist_ok=True)
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        plan = load_plan(args)
        for f in selection.chunk_files(plan):
            if not os.path.isfile(os.path.join(self.tests_dir, f)):
                raise SystemExit("run.py: %s is not in %s" % (f, self.tests_dir))
        self.add_missing_modules()
        for mode in args.modes:
            self.modes[mode] = {"description": MODES[mode]["description"], "env": None,
                                "setup_error": None, "tests": {}}
            menv = self.mode_env(mode)
            settings = ["%s=%s" % (k, menv.get(k) or "(unset)") for k in
                        ("PYTORCH_CUDA_ALLOC_CONF", "GPUALLOC_CONF")
                        if k in menv or (k == "GPUALLOC_CONF" and MODES[mode]["gpualloc"])]
            if settings:
                self.modes[mode]["description"] += " (%s)" % ", ".join(settings)
        self.say("tests from %s; modes %s; %d chunk(s); budget %d s" % (
            self.tests_dir, ", ".join(args.modes), len(plan), args.max_seconds))
        if any(MODES[m]["gpualloc"] for m in args.modes):
            if "GPUALLOC_SO" not in self.base_env:
                error = ("liballoc_ffi.so not found at %s: set GPUALLOC_SO or build "
                         "target/release/liballoc_ffi.so" % self.library)
            else:
                error = self.build_bridge()
            if error:
                self.say(error)
                for m in args.modes:
                    if MODES[m]["gpualloc"]:
                        self.modes[m]["setup_error"] = error
        for chunk in plan:
            for mode in args.modes:
                if self.modes[mode]["setup_error"]:
                    continue
                if self.deadline - now() < args.min_chunk_seconds:
                    self.chunks_info.append({"name": chunk["name"], "mode": mode,
                                             "attempts": 0, "notes": ["not started: budget"]})
                    continue
                self.run_chunk(chunk, mode)
        self.finish(started)

    def spread_chunk_errors(self, plan):
        """A chunk whose process failed before selecting its tests (import error, gpualloc
        not enabled) has one pseudo-test in that mode; its error goes to each test of the
        chunk that another mode ran, so that the comparison shows them."""
        for chunk in plan:
            pseudo = collection_id(chunk)
            for mode, data in self.modes.items():
                err = data["tests"].get(pseudo)
                if err is None:
                    continue
                ids = [t for other, d in self.modes.items() if other != mode
                       for t in d["tests"] if in_chunk(chunk, t) and t not in data["tests"]]
                for t in ids:
                    data["tests"][t] = dict(err)
                if ids:
                    del data["tests"][pseudo]

    def finish(self, started):
        args = self.args
        self.spread_chunk_errors(load_plan(args))
        for mode in args.modes:
            path = os.path.join(self.work, "%s-enable-failures.log" % mode)
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
                if lines:
                    self.notes.append("%s: %d Python process(es) started by the tests could not "
                                      "enable gpualloc (they ran under PyTorch's allocator); "
                                      "first: %s" % (mode, len(lines), report.cell(lines[0], 400)))
        data = {
            "meta": {
                "started": started,
                "seconds": round(now() - self.t0),
                "max_seconds": args.max_seconds,
                "test_timeout": args.test_timeout,
                "keywords": args.keywords,
                "modes": args.modes,
                "python": args.python,
                "sources": read_sources(self.tests_dir),
                "notes": self.notes,
            },
            "modes": self.modes,
            "chunks": self.chunks_info,
        }
        with open(os.path.join(self.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        text = report.render(data)
        with open(os.path.join(self.out, "report.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        pack_logs(self.logs, self.work, os.path.join(self.out, "logs.tar.gz"))
        # The report's head (summary and failures) on stdout too.
        print()
        print(text[:20000])
        print()
        self.say("wrote %s/report.md, results.json, logs.tar.gz" % self.out)


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def collection_id(chunk):
    """The pseudo-test that stands for a chunk whose tests could not even be selected."""
    return "%s::(chunk %s)::(collection)" % (chunk["file"], chunk["name"])


def in_chunk(chunk, tid):
    parts = tid.split("::")
    return (len(parts) == 3 and parts[0] == chunk["file"] and not parts[1].startswith("(")
            and any(selection.class_matches(c, parts[1]) for c in chunk["classes"]))


def describe_exit(rc):
    """'killed by SIGSEGV' / 'exit status 3' for a process's return code."""
    if rc < 0:
        try:
            return "killed by %s" % signal.Signals(-rc).name
        except ValueError:
            return "killed by signal %d" % -rc
    return "exit status %d" % rc


def log_tail(path, lines=LOG_TAIL_LINES):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_line(text):
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def read_sources(tests_dir):
    """The provenance lines of DIR/SOURCE.txt ('file: ...'), if present."""
    out = []
    path = os.path.join(tests_dir, "SOURCE.txt")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if ":" in line and line.split(":", 1)[0].strip().endswith(".py"):
                    name, rest = line.split(":", 1)
                    out.append({"file": name.strip(), "source": rest.strip()})
    return out


def pack_logs(logs_dir, work, dest):
    """One tar.gz of the test processes' output (head and tail of each long log)."""
    with tarfile.open(dest, "w:gz") as tar:
        names = sorted(os.listdir(logs_dir)) if os.path.isdir(logs_dir) else []
        extra = [os.path.join(work, n) for n in sorted(os.listdir(work))
                 if n.endswith("-enable-failures.log")]
        for path in [os.path.join(logs_dir, n) for n in names] + extra:
            with open(path, "rb") as f:
                data = f.read()
            if len(data) > MAX_LOG_BYTES:
                half = MAX_LOG_BYTES // 2
                data = data[:half] + b"\n\n[... %d bytes left out ...]\n\n" % (
                    len(data) - 2 * half) + data[-half:]
            ti = tarfile.TarInfo("logs/" + os.path.basename(path))
            ti.size = len(data)
            ti.mtime = int(time.time())
            tar.addfile(ti, io.BytesIO(data))


def load_plan(args):
    plan = selection.DEFAULT_PLAN
    if args.plan:
        with open(args.plan, encoding="utf-8") as f:
            plan = json.load(f)
    if args.chunks:
        wanted = args.chunks.split(",")
        unknown = [w for w in wanted if w not in [c["name"] for c in plan]]
        if unknown:
            raise SystemExit("run.py: no chunk named %s (chunks: %s)" % (
                ", ".join(unknown), ", ".join(c["name"] for c in plan)))
        plan = [c for c in plan if c["name"] in wanted]
    return plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.splitlines()[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:]))
    p.add_argument("--tests", required=True, help="folder holding PyTorch's test files")
    p.add_argument("--out", required=True, help="folder for report.md, results.json, logs")
    p.add_argument("--modes", default="pytorch,gpualloc",
                   help="comma-separated, from: %s (default: pytorch,gpualloc)"
                   % ", ".join(MODES))
    p.add_argument("-k", dest="keywords", action="append", default=[],
                   help="run only tests whose id (file::Class::test) matches this regular "
                        "expression (repeatable: any)")
    p.add_argument("--all", action="store_true",
                   help="every test of the chunks' classes, not only the allocator ones")
    p.add_argument("--chunks", help="comma-separated chunk names (selection.py) to run")
    p.add_argument("--plan", help="a JSON file with a plan of chunks to use instead")
    p.add_argument("--max-seconds", type=int, default=500,
                   help="time budget of the whole run (default 500)")
    p.add_argument("--test-timeout", type=int, default=150,
                   help="seconds one test may run before its process is killed (default 150)")
    p.add_argument("--stall-timeout", type=int, default=240,
                   help="seconds a test process may go without starting or ending a test "
                        "(importing, class fixtures; default 240)")
    p.add_argument("--min-chunk-seconds", type=int, default=20,
                   help="do not start a chunk with less budget left (default 20)")
    p.add_argument("--gpualloc-conf", help="GPUALLOC_CONF for the gpualloc mode")
    p.add_argument("--slow", action="store_true", help="also the tests marked slow")
    p.add_argument("--python", default=sys.executable, help="interpreter of the test processes")
    p.add_argument("--work", default=os.path.join("/tmp", "gpualloc-pytorch-tests"),
                   help="scratch folder (default /tmp/gpualloc-pytorch-tests)")
    p.add_argument("--keep-work", action="store_true", help="do not clear --work first")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error("unknown mode %r (modes: %s)" % (m, ", ".join(MODES)))
    return args


def main(argv=None):
    Runner(parse_args(argv)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
