"""Reading what one test process (child.py) wrote, and deciding what happened to each test
when the process ended: normally, by a crash, or killed by run.py (no torch needed here)."""
import json

# Outcomes of a test. A test process reports the first six; run.py adds the rest.
OK = ("passed", "xfail")
BAD = ("failed", "error", "crashed", "timeout", "xpass")
SKIPPED = ("skipped",)
NOT_RUN = ("interrupted", "not-run")
OUTCOMES = OK + BAD + SKIPPED + NOT_RUN


def load_events(path):
    """The records of a JSON-lines file; a last line cut short by a crash is ignored."""
    events = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return events


def result(outcome, message="", details="", duration=None):
    r = {"outcome": outcome, "message": message}
    if details:
        r["details"] = details
    if duration is not None:
        r["duration"] = duration
    return r


class Attempt:
    """What one process of a chunk did, from its records:

    plan      the ids it planned (None if it died before planning)
    results   id -> result for the tests that ended
    inflight  the id of the test that started and did not end (None if none)
    fatal     the fatal record (import failed, wrong allocator), if any
    fixture_errors  setUpClass / tearDownClass failures
    env       the env record
    done      whether it ran its whole plan
    """

    def __init__(self, events):
        self.plan = None
        self.results = {}
        self.inflight = None
        self.fatal = None
        self.fixture_errors = []
        self.env = None
        self.done = False
        for ev in events:
            kind = ev.get("event")
            if kind == "plan":
                self.plan = list(ev.get("ids", []))
            elif kind == "env":
                self.env = ev
            elif kind == "start":
                self.inflight = ev.get("id")
            elif kind == "end":
                tid = ev.get("id")
                self.results[tid] = result(ev.get("outcome", "error"), ev.get("message", ""),
                                           ev.get("details", ""), ev.get("duration"))
                if self.inflight == tid:
                    self.inflight = None
            elif kind == "fixture_error":
                self.fixture_errors.append(ev)
            elif kind == "fatal":
                self.fatal = ev
            elif kind == "done":
                self.done = True


def fixture_error_for(tid, fixture_errors):
    """The setUpClass / tearDownClass error that concerns a test's class, if any
    (unittest names them 'setUpClass (module.Class)')."""
    cls = tid.split("::")[1] if "::" in tid else ""
    for fe in fixture_errors:
        desc = fe.get("description", "")
        if desc.endswith("." + cls + ")") or ("." + cls + ")") in desc:
            return fe
    return fixture_errors[0] if fixture_errors else None


FRAME_PREFIXES = ("File \"", "Current thread", "Thread 0x", "Stack (most recent",
                  "Extension modules:", "<no Python frame>", "Traceback (most recent")
MARKERS = ("what():", "Fatal Python error", "terminate called", "CUDA error", "Error", "error")


def crash_line(log_tail):
    """The most telling line of a dead process's last output: a C++ exception's what(), a
    fatal error, else the last line that is not part of a printed stack."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(FRAME_PREFIXES)]
    for marker in MARKERS:
        for ln in lines:
            if marker in ln:
                return ln
    return lines[-1] if lines else ""


def settle(attempt, planned, end_reason, log_tail=""):
    """Decides the outcome of the tests of an attempt that ended.

    planned: the ids this attempt was to run (its own plan when it got that far; for a
        restart, the ids it was given).
    end_reason: None when the process exited by itself, else why run.py stopped it:
        'timeout' (a test ran past --test-timeout), 'budget' (--max-seconds ran out),
        'stalled' (no progress outside a test).
    Returns (results, remaining): results for tests decided here (ended ones included);
    remaining, the ids a new process should still run (empty when nothing should be
    retried)."""
    results = dict(attempt.results)
    planned = list(attempt.plan if attempt.plan is not None else (planned or []))
    tail_line = crash_line(log_tail)

    if attempt.fatal is not None:
        message = attempt.fatal.get("message", "fatal error")
        for tid in planned:
            results.setdefault(tid, result("error", message, attempt.fatal.get("details", "")))
        return results, []

    inflight = attempt.inflight
    if inflight is not None:
        if end_reason == "timeout":
            results[inflight] = result("timeout", "ran past the per-test timeout; its process "
                                       "was killed", log_tail)
        elif end_reason == "budget":
            results[inflight] = result("interrupted", "the run's time budget ran out while it "
                                       "ran", log_tail)
        else:
            why = "its process died" + (" (%s)" % end_reason if end_reason else "")
            if tail_line:
                why += ": " + tail_line
            results[inflight] = result("crashed", why, log_tail)

    undecided = [t for t in planned if t not in results]
    if attempt.done:
        # Planned tests that never started: their class fixture failed, or unittest
        # skipped them without a record.
        for tid in undecided:
            fe = fixture_error_for(tid, attempt.fixture_errors)
            if fe is not None:
                results[tid] = result("error", "class fixture: " + fe.get("message", ""),
                                      fe.get("details", ""))
            else:
                results[tid] = result("error", "no result was recorded for this test")
        return results, []
    if end_reason == "budget":
        for tid in undecided:
            results[tid] = result("not-run", "the run's time budget ran out")
        return results, []
    if attempt.plan is None and planned == []:
        return results, []
    progressed = bool(attempt.results) or inflight is not None
    if not progressed:
        # Died (or stalled) before any test started and without saying why: a restart
        # would do the same.
        why = "its process ended before running any test"
        if end_reason:
            why += " (%s)" % end_reason
        if tail_line:
            why += ": " + tail_line
        for tid in undecided:
            results[tid] = result("error", why, log_tail)
        return results, []
    return results, undecided
