"""Merging the per-mode results of run.py and writing them as a markdown report (no torch
needed here).

results.json, which run.py writes and `render` reads:

    {"meta": {...},
     "modes": {"pytorch": {"description": ..., "env": {...}, "setup_error": null,
                           "tests": {test id: {"outcome": ..., "message": ..., ...}}},
               "gpualloc": {...}},
     "chunks": [{"name": ..., "mode": ..., "seconds": ..., "attempts": ..., ...}]}
"""
import collections

from events import BAD, NOT_RUN, OK, OUTCOMES, SKIPPED

# The mode each gpualloc mode is compared with.
BASELINES = {
    "gpualloc": "pytorch",
    "gpualloc-expandable": "pytorch-expandable",
}

SUMMARY_COLUMNS = ("passed", "failed", "error", "crashed", "timeout", "skipped", "xfail",
                   "xpass", "interrupted", "not-run")


def baseline_of(mode, modes):
    """The mode a gpualloc mode is compared with (PyTorch's allocator in the same settings
    when that ran, else plain PyTorch); None for PyTorch's own modes."""
    if not mode.startswith("gpualloc"):
        return None
    base = BASELINES.get(mode, "pytorch")
    if base in modes:
        return base
    return "pytorch" if "pytorch" in modes else None


def all_ids(modes):
    """Every test id that any mode planned or ran, in first-seen order."""
    seen = collections.OrderedDict()
    for data in modes.values():
        for tid in data.get("tests", {}):
            seen[tid] = True
    return list(seen)


def outcome_of(modes, mode, tid):
    """A mode's result for a test; tests a mode never reached are 'not-run'."""
    r = modes.get(mode, {}).get("tests", {}).get(tid)
    if r is not None:
        return r
    error = modes.get(mode, {}).get("setup_error")
    if error:
        return {"outcome": "error", "message": "setup failed: " + error}
    return {"outcome": "not-run", "message": "not reached"}


def classify(base, other):
    """The report's category for one test: its outcome under the baseline and under the
    other mode."""
    b, o = base["outcome"], other["outcome"]
    if b in NOT_RUN or o in NOT_RUN:
        return "not run"
    if o in BAD and b in BAD:
        return "failing under both"
    if o in BAD:
        return "failing only under gpualloc"
    if b in BAD:
        return "failing only under pytorch"
    if o in SKIPPED or b in SKIPPED:
        return "skipped"
    return "passed under both"


CATEGORIES = ("failing only under gpualloc", "failing only under pytorch",
              "failing under both", "passed under both", "skipped", "not run")


def compare(modes, base_mode, mode):
    """{category: [test id, ...]} for `mode` against `base_mode`."""
    out = collections.OrderedDict((c, []) for c in CATEGORIES)
    for tid in all_ids(modes):
        out[classify(outcome_of(modes, base_mode, tid), outcome_of(modes, mode, tid))].append(tid)
    return out


def counts(modes, mode):
    """Outcome counts of one mode over every test id of the run."""
    c = collections.Counter()
    for tid in all_ids(modes):
        c[outcome_of(modes, mode, tid)["outcome"]] += 1
    return c


def cell(text, limit=220):
    """Text fit for one markdown table cell."""
    text = " ".join(str(text or "").split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def short_id(tid):
    """`test_cuda.py::TestMemPool::test_x` as `TestMemPool.test_x` (file kept for others)."""
    parts = tid.split("::")
    if len(parts) == 3 and parts[0] == "test_cuda.py":
        return "%s.%s" % (parts[1], parts[2])
    if len(parts) == 3:
        return "%s: %s.%s" % (parts[0][:-3] if parts[0].endswith(".py") else parts[0],
                             parts[1], parts[2])
    return tid


def selected_table(modes):
    """Markdown lines: how many tests of each file and class the run planned."""
    per = collections.OrderedDict()
    for tid in all_ids(modes):
        parts = tid.split("::")
        key = (parts[0], parts[1] if len(parts) > 1 else "")
        per[key] = per.get(key, 0) + 1
    lines = ["| file | class | tests |", "|---|---|---:|"]
    for (f, c), n in per.items():
        lines.append("| %s | %s | %d |" % (f, c, n))
    lines.append("| | total | %d |" % sum(per.values()))
    return lines


def render(data):
    """The markdown report of a results.json structure."""
    meta = data.get("meta", {})
    modes = data.get("modes", {})
    mode_names = list(modes)
    lines = ["# PyTorch's own allocator tests under PyTorch's allocator and under gpualloc", ""]
    env = {}
    for m in mode_names:
        env = modes[m].get("env") or env
        if env:
            break
    facts = []
    if env.get("torch"):
        facts.append("torch %s" % env["torch"])
    if env.get("device"):
        facts.append(env["device"])
    if env.get("python"):
        facts.append("Python %s" % env["python"])
    if facts:
        lines.append(", ".join(facts) + ".")
    for src in meta.get("sources", []):
        lines.append("- `%s`: %s" % (src.get("file"), src.get("source", "")))
    if meta.get("started"):
        lines.append("")
        lines.append("Run %s; %s s of a %s s budget; per-test timeout %s s." % (
            meta.get("started"), meta.get("seconds"), meta.get("max_seconds"),
            meta.get("test_timeout")))
    if meta.get("keywords"):
        lines.append("Selection narrowed with -k %s." % ", ".join(
            "`%s`" % k for k in meta["keywords"]))
    lines.append("")
    lines.append("## Modes")
    lines.append("")
    for m in mode_names:
        d = modes[m]
        line = "- **%s**: %s" % (m, d.get("description", ""))
        st = (d.get("env") or {}).get("gpualloc")
        if st:
            line += " (library %s, version %s, bridge %s)" % (
                st.get("library"), st.get("version"), "yes" if st.get("bridge") else "no")
        if d.get("setup_error"):
            line += " -- **setup failed**: %s" % cell(d["setup_error"], 600)
        lines.append(line)
    lines.append("")
    lines.append("## Summary")
    lines.append("")
    lines.append("| mode | tests | " + " | ".join(SUMMARY_COLUMNS) + " |")
    lines.append("|---|---:|" + "---:|" * len(SUMMARY_COLUMNS))
    total = len(all_ids(modes))
    for m in mode_names:
        c = counts(modes, m)
        lines.append("| %s | %d | %s |" % (m, total, " | ".join(
            str(c.get(k, 0)) for k in SUMMARY_COLUMNS)))
    lines.append("")

    for m in mode_names:
        base = baseline_of(m, modes)
        if base is None:
            continue
        cmp_ = compare(modes, base, m)
        lines.append("## %s against %s" % (m, base))
        lines.append("")
        for cat in CATEGORIES:
            lines.append("- %s: %d" % (cat.replace("gpualloc", m).replace("pytorch", base),
                                       len(cmp_[cat])))
        lines.append("")
        for cat in ("failing only under gpualloc", "failing under both",
                    "failing only under pytorch"):
            ids = cmp_[cat]
            if not ids:
                continue
            lines.append("### %s (%d)" % (cat.replace("gpualloc", m).replace("pytorch", base)
                                          .capitalize(), len(ids)))
            lines.append("")
            lines.append("| test | %s | %s | first line of the error |" % (base, m))
            lines.append("|---|---|---|---|")
            for tid in ids:
                b, o = outcome_of(modes, base, tid), outcome_of(modes, m, tid)
                msg = o["message"] if o["outcome"] in BAD else b["message"]
                if cat == "failing under both" and b["message"] != o["message"]:
                    msg = "%s: %s / %s: %s" % (base, b["message"], m, o["message"])
                lines.append("| %s | %s | %s | %s |" % (cell(short_id(tid), 120), b["outcome"],
                                                      o["outcome"], cell(msg, 300)))
            lines.append("")
        if cmp_["skipped"]:
            lines.append("### Skipped (%d)" % len(cmp_["skipped"]))
            lines.append("")
            lines.append("| test | %s | %s | reason |" % (base, m))
            lines.append("|---|---|---|---|")
            for tid in cmp_["skipped"]:
                b, o = outcome_of(modes, base, tid), outcome_of(modes, m, tid)
                reason = o["message"] if o["outcome"] in SKIPPED else b["message"]
                lines.append("| %s | %s | %s | %s |" % (cell(short_id(tid), 120), b["outcome"],
                                                      o["outcome"], cell(reason, 160)))
            lines.append("")
        if cmp_["not run"]:
            lines.append("### Not run (%d)" % len(cmp_["not run"]))
            lines.append("")
            for tid in cmp_["not run"]:
                b, o = outcome_of(modes, base, tid), outcome_of(modes, m, tid)
                lines.append("- %s: %s %s, %s %s" % (cell(short_id(tid), 120), base,
                                                    b["outcome"], m, o["outcome"]))
            lines.append("")
        if cmp_["passed under both"]:
            lines.append("### Passed under both (%d)" % len(cmp_["passed under both"]))
            lines.append("")
            lines.append(", ".join(short_id(t) for t in cmp_["passed under both"]))
            lines.append("")

    lines.append("## Selected tests")
    lines.append("")
    lines.extend(selected_table(modes))
    lines.append("")
    chunks = data.get("chunks", [])
    if chunks:
        lines.append("## Processes")
        lines.append("")
        lines.append("| chunk | mode | tests | seconds | processes | notes |")
        lines.append("|---|---|---:|---:|---:|---|")
        for ch in chunks:
            lines.append("| %s | %s | %s | %s | %s | %s |" % (
                ch.get("name"), ch.get("mode"), ch.get("tests", ""), ch.get("seconds", ""),
                ch.get("attempts", ""), cell("; ".join(ch.get("notes", [])), 300)))
        lines.append("")
    notes = meta.get("notes", [])
    if notes:
        lines.append("## Notes")
        lines.append("")
        for n in notes:
            lines.append("- " + n)
        lines.append("")
    return "\n".join(lines)


def check_outcomes(data):
    """Names of unknown outcomes in a results structure (a sanity check for tests)."""
    bad = set()
    for d in data.get("modes", {}).values():
        for r in d.get("tests", {}).values():
            if r.get("outcome") not in OUTCOMES:
                bad.add(r.get("outcome"))
    return sorted(bad)


__all__ = ["BASELINES", "CATEGORIES", "OK", "BAD", "SKIPPED", "NOT_RUN", "baseline_of",
           "classify", "compare", "counts", "render", "all_ids", "outcome_of"]
