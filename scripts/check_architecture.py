#!/usr/bin/env python3
"""Checks that the picture at the top of docs/architecture.md names only what exists.

The picture is the first ```text block of the file. Every path in it (crates/..., python/...)
must exist; every file name (foo.rs, bridge.cpp, ...) and folder name (engine/) must be a
file or folder somewhere in the repository's sources; every capitalised word must be a type
(struct, enum, trait or type alias in Rust, class or struct in C++) defined there, unless it
is one of the few outside names below; and every crate of the workspace must appear.
A type followed by a Rust file in parentheses, `StreamOrder (engine/stream_order.rs)`, must
be defined in a file at that path (or ending with it); and the type of every field of
`Engine` (crates/alloc-core/src/engine.rs) that the repository defines must be named: the
picture shows every part the engine holds.

    python3 scripts/check_architecture.py              # check docs/architecture.md
    python3 scripts/check_architecture.py --self-test  # the checker finds what it should
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ["crates", "python", "xtask", "scripts", "benchmarks"]
# Words of the picture that name something outside this repository.
OUTSIDE = {"PyTorch", "Python", "Rust", "Mutex", "CUDAAllocator"}
# Build products: named in the picture, absent from a clone.
BUILT = {"liballoc_ffi.so"}

PATH_RE = re.compile(r"\b(?:crates|python|xtask|scripts|benchmarks)(?:/[\w.-]+)+/?")
FILE_RE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:rs|cpp|h|py|so))\b")
DIR_RE = re.compile(r"(?<![\w/.-])([a-z_]+)/(?![\w.])")
TYPE_RE = re.compile(r"(?<![\w.:'])([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\b")
CRATE_RE = re.compile(r"\b(alloc-[a-z]+|xtask)\b")
PLACED_RE = re.compile(r"\b([A-Z]\w*) \(((?:[\w-]+/)*[\w-]+\.rs)\b")
ENGINE_RS = os.path.join("crates", "alloc-core", "src", "engine.rs")


def picture(markdown):
    """The first ```text block of a Markdown text."""
    m = re.search(r"^```text\n(.*?)^```", markdown, re.S | re.M)
    if not m:
        raise SystemExit("docs/architecture.md: no ```text picture")
    return m.group(1)


def source_index(root):
    """(file names, folder names, {defined type name: the files defining it}) of the
    repository's sources, files as paths relative to the root."""
    files, dirs, types = set(), set(), {}
    defn = re.compile(
        r"^\s*(?:pub(?:\([\w:]+\))?\s+)?(?:struct|enum|trait|type|union|class)\s+([A-Za-z_]\w*)",
        re.M,
    )
    for top in SOURCE_DIRS:
        for d, subdirs, names in os.walk(os.path.join(root, top)):
            subdirs[:] = [s for s in subdirs if s not in ("target", "__pycache__", ".git")]
            dirs.update(subdirs)
            for name in names:
                files.add(name)
                if name.endswith((".rs", ".cpp", ".h")):
                    path = os.path.join(d, name)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        for t in defn.findall(f.read()):
                            types.setdefault(t, set()).add(os.path.relpath(path, root))
    return files, dirs, types


def workspace_crates(root):
    """The workspace members' folder names (alloc-core, ..., xtask)."""
    with open(os.path.join(root, "Cargo.toml"), encoding="utf-8") as f:
        text = f.read()
    members = re.search(r"members\s*=\s*\[(.*?)\]", text, re.S).group(1)
    return {os.path.basename(m) for m in re.findall(r'"([^"]+)"', members)}


def engine_field_types(root, types):
    """The types the repository defines that `Engine`'s fields are made of."""
    path = os.path.join(root, ENGINE_RS)
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^pub struct Engine<[^>]*> \{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        return set()
    body = "\n".join(l for l in m.group(1).splitlines() if not l.strip().startswith("//"))
    found = set()
    for ty in re.findall(r"^\s*\w+:\s*(.+?),?\s*$", body, re.M):
        found.update(t for t in re.findall(r"(?<!::)\b[A-Z]\w*\b", ty) if t in types and len(t) > 1)
    return found


def problems(pic, root):
    """What the picture names that does not exist, and the crates it leaves out."""
    files, dirs, types = source_index(root)
    found = []
    for path in sorted(set(PATH_RE.findall(pic))):
        if not os.path.exists(os.path.join(root, path.rstrip("/"))):
            found.append("no such path: %s" % path)
    without_paths = PATH_RE.sub(" ", pic)
    for name in sorted(set(FILE_RE.findall(without_paths))):
        if name not in files and name not in BUILT:
            found.append("no such file: %s" % name)
    for name in sorted(set(DIR_RE.findall(without_paths))):
        if name not in dirs:
            found.append("no such folder: %s/" % name)
    for name in sorted(set(TYPE_RE.findall(pic))):
        if name not in types and name not in OUTSIDE:
            found.append("no such type: %s" % name)
    for name, file in sorted(set(PLACED_RE.findall(pic))):
        homes = types.get(name, set())
        if homes and not any(("/" + h).endswith("/" + file) for h in homes):
            found.append("%s is not defined in %s" % (name, file))
    for name in sorted(engine_field_types(root, types) - set(TYPE_RE.findall(pic))):
        found.append("a part of Engine not in the picture: %s" % name)
    named = set(CRATE_RE.findall(pic))
    for crate in sorted(workspace_crates(root) - named):
        found.append("crate not in the picture: %s" % crate)
    for crate in sorted(named - workspace_crates(root)):
        found.append("no such crate: %s" % crate)
    return found


def self_test():
    """The checker passes a picture of things that exist and flags each kind of mistake."""
    crates = " ".join("crates/%s" % c for c in sorted(workspace_crates(ROOT)) if c != "xtask")
    _, _, types = source_index(ROOT)
    parts = " ".join(sorted(engine_field_types(ROOT, types)))
    assert {"Heap", "StreamOrder", "SleepTags", "PrivatePools"} <= set(parts.split()), parts
    good = "%s xtask\n Engine (engine.rs), Heap (heap.rs), engine/, python/gpu_alloc/bridge.cpp\n%s\n" % (
        crates,
        parts,
    )
    assert problems(good, ROOT) == [], problems(good, ROOT)
    for bad, expected in [
        ("crates/alloc-nothing", "no such path: crates/alloc-nothing"),
        ("Engine (enjine.rs)", "no such file: enjine.rs"),
        ("the parts in enjine/", "no such folder: enjine/"),
        ("EngineParts (engine.rs)", "no such type: EngineParts"),
        ("SleepTags (engine/stream_order.rs)", "SleepTags is not defined in engine/stream_order.rs"),
    ]:
        got = problems(good + bad + "\n", ROOT)
        assert expected in got, (bad, got)
    missing = good.replace("crates/alloc-core", "")
    assert "crate not in the picture: alloc-core" in problems(missing, ROOT), problems(missing, ROOT)
    no_order = good.replace("StreamOrder", "")
    got = problems(no_order, ROOT)
    assert "a part of Engine not in the picture: StreamOrder" in got, got


def main():
    self_test()
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        found = problems(picture(f.read()), ROOT)
    for p in found:
        print("docs/architecture.md: %s" % p, file=sys.stderr)
    if found:
        return 1
    print("docs/architecture.md: the picture names only what exists, and every crate")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        print("self-test passed")
        sys.exit(0)
    sys.exit(main())
