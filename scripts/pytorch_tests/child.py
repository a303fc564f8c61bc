"""Runs some tests of one PyTorch test file in this process and writes one JSON object per
line to --results as it goes, flushed at once, so that a crash loses nothing but the test
that was running (run.py starts it; see run.py for the whole picture):

    {"event": "boot", ...}                          the process started
    {"event": "env", ...}                           versions; whether gpualloc is the allocator
    {"event": "plan", "ids": [...]}                 the tests it is about to run, in order
    {"event": "start", "id": ...}                   a test begins
    {"event": "end", "id": ..., "outcome": ...}     ... and ends: passed, failed, error,
                                                    skipped, xfail, xpass
    {"event": "fixture_error", "description": ...}  setUpClass / tearDownClass failed
    {"event": "fatal", "message": ...}              the file could not be imported, or the
                                                    mode's allocator is not the one asked for
    {"event": "done"}                               every planned test ran

The tests are PyTorch's unittest classes (torch.testing._internal.common_utils.TestCase);
they run through unittest.TestSuite, which runs setUpClass / tearDownClass, after the
command-line parsing PyTorch's run_tests() does. No pytest is needed.
"""
import argparse
import faulthandler
import importlib
import json
import os
import sys
import time
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import selection  # noqa: E402

MAX_DETAILS = 6000


class Emitter:
    def __init__(self, path):
        self.f = open(path, "a", encoding="utf-8")

    def __call__(self, record):
        record.setdefault("time", time.time())
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()


def first_line(text):
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe(err):
    """(message, details) of an exc_info triple: 'Type: first line of the message' and the
    formatted traceback (its end kept when long)."""
    etype, value, tb = err
    message = etype.__name__
    line = first_line(value)
    if line:
        message += ": " + line
    details = "".join(traceback.format_exception(etype, value, tb))
    if len(details) > MAX_DETAILS:
        details = "...\n" + details[-MAX_DETAILS:]
    return message, details


# Which outcome wins when a test reports several (a subtest failure, then an error in
# tearDown, ...).
RANK = {"passed": 0, "skipped": 1, "xfail": 2, "xpass": 3, "failed": 4, "error": 5}


class Recorder(unittest.TestResult):
    """A TestResult that emits one start and one end record per test."""

    def __init__(self, emit, file):
        super().__init__()
        self.emit = emit
        self.file = file
        self.current = None

    def tid(self, test):
        cls = type(test).__name__
        return selection.test_id(self.file, cls, getattr(test, "_testMethodName", str(test)))

    def startTest(self, test):
        super().startTest(test)
        self.current = {"id": self.tid(test), "outcome": "passed", "message": "",
                        "details": "", "t0": time.time()}
        self.emit({"event": "start", "id": self.current["id"]})

    def _set(self, outcome, message="", details=""):
        cur = self.current
        if cur is None:
            return
        if RANK[outcome] >= RANK[cur["outcome"]]:
            if RANK[outcome] > RANK[cur["outcome"]] or not cur["message"]:
                cur["message"], cur["details"] = message, details
            cur["outcome"] = outcome

    def stopTest(self, test):
        super().stopTest(test)
        cur = self.current
        if cur is not None:
            self.emit({"event": "end", "id": cur["id"], "outcome": cur["outcome"],
                       "message": cur["message"], "details": cur["details"],
                       "duration": round(time.time() - cur["t0"], 3)})
        self.current = None

    def addError(self, test, err):
        super().addError(test, err)
        message, details = describe(err)
        if not isinstance(test, unittest.TestCase):
            # A class or module fixture (setUpClass, tearDownClass): unittest's _ErrorHolder.
            self.emit({"event": "fixture_error", "description": str(test),
                       "message": message, "details": details})
            return
        self._set("error", message, details)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set("failed", *describe(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set("skipped", first_line(reason) or "skipped", str(reason)[:MAX_DETAILS])

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set("xfail", *describe(err))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set("xpass", "unexpected success of a test marked expectedFailure")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            message, details = describe(err)
            outcome = "failed" if issubclass(err[0], test.failureException) else "error"
            self._set(outcome, "%s %s" % (subtest._subDescription(), message), details)


def gpualloc_status():
    """What the sitecustomize of run.py did in this process (None when it is not loaded)."""
    mod = sys.modules.get("sitecustomize")
    return getattr(mod, "GPUALLOC_TESTS_STATUS", None)


def add_compat_names():
    """Defines, in the installed torch's test helpers, the names that newer test files
    import from them and that this torch lacks, as the test files of its own release define
    them. Returns the names added (none when the helpers have them all)."""
    try:
        import torch
        from torch.testing._internal import common_utils
    except ImportError:
        return []
    added = []
    if not hasattr(common_utils, "TEST_CUDAMALLOCASYNC"):
        # torch 2.11's test_cuda.py defines this itself; later ones import it from here.
        common_utils.TEST_CUDAMALLOCASYNC = bool(common_utils.TEST_CUDA) and (
            torch.cuda.get_allocator_backend() == "cudaMallocAsync")
        added.append("common_utils.TEST_CUDAMALLOCASYNC")
    return added


def test_classes(module):
    """(name, class) of the unittest classes defined in `module`, in source order."""
    out = []
    for name, obj in vars(module).items():
        if (isinstance(obj, type) and issubclass(obj, unittest.TestCase)
                and obj.__module__ == module.__name__):
            out.append((name, obj))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", required=True, help="folder of the test files")
    p.add_argument("--file", required=True, help="test file, e.g. test_cuda.py")
    p.add_argument("--results", required=True, help="JSON-lines file to append to")
    p.add_argument("--chunk-json", help="the chunk (selection.py) to select tests from")
    p.add_argument("--ids-file", help="run exactly these test ids (one a line) instead")
    p.add_argument("-k", dest="keywords", action="append", default=[])
    p.add_argument("--all", action="store_true", help="ignore the chunk's include/exclude")
    p.add_argument("--expect-gpualloc", action="store_true",
                   help="refuse to run unless gpualloc is the allocator (with its bridge)")
    args = p.parse_args(argv)

    emit = Emitter(args.results)
    emit({"event": "boot", "pid": os.getpid()})
    # A crash prints the Python stack of every thread into the log run.py keeps.
    faulthandler.enable(all_threads=True)
    tests_dir = os.path.abspath(args.tests)
    sys.path.insert(0, tests_dir)
    # PyTorch's helpers look at sys.argv[0] for the running script.
    sys.argv = [os.path.join(tests_dir, args.file)]

    status = gpualloc_status()
    if args.expect_gpualloc and not (status and status.get("enabled") and status.get("bridge")):
        emit({"event": "fatal", "message": "gpualloc is not the allocator of this process: %s"
              % ((status or {}).get("error") or "its sitecustomize did not run")})
        return 3

    module_name = args.file[:-3] if args.file.endswith(".py") else args.file
    try:
        compat = add_compat_names()
        module = importlib.import_module(module_name)
    except BaseException:  # noqa: B036 - report anything, SystemExit and skips included
        message, details = describe(sys.exc_info())
        emit({"event": "fatal", "message": "importing %s failed: %s" % (args.file, message),
              "details": details})
        return 4
    common_utils = sys.modules.get("torch.testing._internal.common_utils")
    if common_utils is not None and hasattr(common_utils, "parse_cmd_line_args"):
        common_utils.parse_cmd_line_args()  # what run_tests() does first

    classes = dict(test_classes(module))
    loader = unittest.TestLoader()
    if args.ids_file:
        with open(args.ids_file, encoding="utf-8") as f:
            ids = [line.strip() for line in f if line.strip()]
    else:
        chunk = json.loads(args.chunk_json)
        available = [(name, m) for name, cls in classes.items()
                     for m in loader.getTestCaseNames(cls)]
        ids = selection.select(chunk, available, args.keywords, args.all)

    env = {"event": "env", "python": sys.version.split()[0], "gpualloc": status,
           "compat": compat}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        try:
            env["allocator_backend"] = torch.cuda.get_allocator_backend()
            env["device"] = torch.cuda.get_device_name(0)
        except Exception as e:  # noqa: BLE001 - informational only
            env["device_error"] = str(e)
    emit(env)
    emit({"event": "plan", "ids": ids})

    suite = unittest.TestSuite()
    for tid in ids:
        _, cls_name, method = selection.split_id(tid)
        suite.addTest(classes[cls_name](method))
    result = Recorder(emit, args.file)
    suite.run(result)
    emit({"event": "done"})
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the results are written, and tearing down CUDA, threads
    # and extension modules of a test process is where hangs and crashes happen.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
