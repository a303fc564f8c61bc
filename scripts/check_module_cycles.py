#!/usr/bin/env python3
"""Checks that the files of a crate use each other without circles.

Each file of a crate's src/ (binaries in src/bin/ left out) is one module. Module A uses
module B when A's code (comments and string literals left out) names a path that leads into
B: `crate::b::...`, `super::...`, `self::b::...`, or a child module's name `b::...`. A path
naming an item the crate root re-exports (`crate::Thing` where lib.rs says `pub use b::Thing`)
leads to the module that defines it. `mod b;` declarations and the root's re-exports are not
uses: the root only assembles the crate, so its own items are leaves; nor is a module's
`pub use child::...` of its own child modules, which assembles the same way. Inline modules
(`mod tests { use super::*; }`) belong to their file.

    python3 scripts/check_module_cycles.py crates/alloc-core crates/alloc-cuda   # fails on a circle
    python3 scripts/check_module_cycles.py --report crates/alloc-policy   # lists, never fails
    python3 scripts/check_module_cycles.py --graph crates/alloc-cuda    # prints the edges
    python3 scripts/check_module_cycles.py --self-test
"""
import os
import re
import sys
import tempfile

IDENT = r"[A-Za-z_]\w*"


def blank(text):
    """The text with comments, string and character literals replaced by spaces
    (newlines kept, so positions and line numbers stay)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1 : i]):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(?:\\(?:x\w\w|u\{\w+\}|.)|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def modules(src):
    """{module path (tuple of names): file} for a crate's src/ folder."""
    found = {}
    for d, subdirs, names in os.walk(src):
        rel = os.path.relpath(d, src)
        parts = () if rel == "." else tuple(rel.split(os.sep))
        if parts[:1] == ("bin",):
            subdirs[:] = []
            continue
        for name in names:
            if not name.endswith(".rs"):
                continue
            stem = name[:-3]
            if not parts and stem in ("lib", "main"):
                path = ()
            elif stem == "mod":
                path = parts
            else:
                path = parts + (stem,)
            found[path] = os.path.join(d, name)
    return found


def use_trees(code):
    """(position, path) of every `use` declaration's leaves, braces expanded."""
    for m in re.finditer(r"\buse\s+([^;]*);", code):
        tree = re.sub(r"\s+", "", m.group(1))
        for path in expand(tree):
            yield m.start(), path


def expand(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    brace = tree.find("{")
    if brace < 0:
        return [p for p in tree.split(",") if p]
    prefix, depth, parts, start = tree[:brace], 0, [], brace + 1
    end = brace
    for k in range(brace, len(tree)):
        if tree[k] == "{":
            depth += 1
        elif tree[k] == "}":
            depth -= 1
            if depth == 0:
                end = k
                break
        elif tree[k] == "," and depth == 1:
            parts.append(tree[start:k])
            start = k + 1
    parts.append(tree[start:end])
    leaves = [prefix + leaf for part in parts if part for leaf in expand(part)]
    rest = tree[end + 1 :].lstrip(",")
    return leaves + (expand(rest) if rest else [])


def inline_modules(code):
    """(start, end) spans of inline `mod name { ... }` blocks."""
    spans = []
    for m in re.finditer(r"\bmod\s+" + IDENT + r"\s*\{", code):
        depth = 0
        for k in range(m.end() - 1, len(code)):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    spans.append((m.start(), k))
                    break
    return spans


def root_reexports(code, mods):
    """{item name: module path} of the root's `pub use module::{Item, ...}`."""
    items = {}
    for m in re.finditer(r"\bpub\s+use\s+([^;]*);", code):
        for path in expand(re.sub(r"\s+", "", m.group(1))):
            segs = [s.split("as")[0] for s in path.split("::")]
            target = walk((), segs[:-1], mods)
            if target:
                name = path.split("::")[-1]
                name = name.split("as")[-1] if "as" in name else name
                items[name] = target
    return items


def walk(base, segs, mods):
    """The deepest module reached from `base` by following `segs`."""
    here = tuple(base)
    for s in segs:
        if here + (s,) in mods:
            here = here + (s,)
        else:
            break
    return here


def without_facade(path, code, mods):
    """`code` with its `pub use child::...;` re-exports of its own child modules blanked:
    like the root's, a module's re-export of its children assembles, it does not use."""
    children = [p[-1] for p in mods if len(p) == len(path) + 1 and p[:-1] == path]
    for child in children:
        code = re.sub(r"\bpub\s+use\s+" + child + r"::[^;]*;",
                      lambda m: " " * len(m.group(0)), code)
    return code


def uses(path, code, mods, reexports):
    """The modules that the module `path` (whose blanked code is `code`) uses."""
    code = without_facade(path, code, mods)
    spans = inline_modules(code)
    found = set()

    def resolve(pos, segs):
        depth = sum(1 for a, b in spans if a < pos < b)
        if segs[0] == "crate":
            rest = segs[1:]
            if rest and rest[0] in reexports and () + (rest[0],) not in mods:
                return reexports[rest[0]]
            return walk((), rest, mods)
        if segs[0] == "super":
            ups = 0
            while ups < len(segs) and segs[ups] == "super":
                ups += 1
            ups -= depth  # the first `super`s leave inline modules of this file
            if ups <= 0:
                return path
            return walk(path[: len(path) - ups], segs[ups + depth :], mods)
        if segs[0] == "self":
            return walk(path, segs[1:], mods) if depth == 0 else path
        if depth == 0 and path + (segs[0],) in mods:
            return walk(path, segs, mods)
        return None

    for pos, p in use_trees(code):
        segs = [s for s in p.split("::") if s]
        if segs:
            found.add(resolve(pos, segs))
    for m in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::" + IDENT + r")+)", code):
        found.add(resolve(m.start(), m.group(1).split("::")))
    for child in (p[-1] for p in mods if len(p) == len(path) + 1 and p[:-1] == path):
        for m in re.finditer(r"(?<![\w:])" + child + r"::" + IDENT, code):
            if not re.search(r"\bmod\s*$", code[max(0, m.start() - 8) : m.start()]):
                found.add(resolve(m.start(), m.group(0).split("::")))
    found.discard(None)
    found.discard(path)
    return found


def graph(crate):
    """{module: set of modules it uses} of a crate folder."""
    src = os.path.join(crate, "src")
    mods = modules(src)
    codes = {}
    for p, f in mods.items():
        with open(f, encoding="utf-8") as fh:
            codes[p] = blank(fh.read())
    reexports = root_reexports(codes.get((), ""), mods)
    edges = {}
    for p, code in codes.items():
        edges[p] = set() if p == () else uses(p, code, mods, reexports)
    return edges


def cycles(edges):
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def name(path, mods_files=None):
    """A module's file-like name: engine/growable.rs, lib.rs."""
    return "/".join(path) + ".rs" if path else "lib.rs"


def describe(group, edges):
    """One circle as its modules and the edges between them."""
    inside = set(group)
    arrows = [
        f"{name(a)} -> {name(b)}" for a in group for b in sorted(edges[a]) if b in inside
    ]
    return ", ".join(name(m) for m in group) + ": " + "; ".join(arrows)


def self_test():
    """The checker finds a circle, through re-exports and parents, and passes a tree."""
    files = {
        "lib.rs": "mod a;\nmod b;\nmod c;\npub use b::Thing;\npub struct Root;\n",
        "a.rs": "use crate::Thing;\n// use crate::c::X;\nconst S: &str = \"crate::c::Y\";\n",
        "b.rs": "use crate::{Root, c::{Z, W}};\npub struct Thing;\n",
        "c.rs": "mod inner;\nfn f() -> inner::Q { todo!() }\n"
        "#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::a::A;\n}\n",
        "c/inner.rs": "use super::super::b::Thing;\npub struct Q;\n",
    }
    with tempfile.TemporaryDirectory() as d:
        for f, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, "src", f)), exist_ok=True)
            with open(os.path.join(d, "src", f), "w") as fh:
                fh.write(text)
        e = graph(d)
        want = {
            (): set(),
            ("a",): {("b",)},
            ("b",): {(), ("c",)},
            ("c",): {("c", "inner"), ("a",)},
            ("c", "inner"): {("b",)},
        }
        assert e == want, e
        assert cycles(e) == [[("a",), ("b",), ("c",), ("c", "inner")]], cycles(e)
        # Without the test's use of `a` and the child's of `b`, no circle is left.
        with open(os.path.join(d, "src", "c.rs"), "w") as fh:
            fh.write("mod inner;\nfn f() -> inner::Q { todo!() }\n")
        with open(os.path.join(d, "src", "c", "inner.rs"), "w") as fh:
            fh.write("pub struct Q;\n")
        assert cycles(graph(d)) == [], cycles(graph(d))
        # A module re-exporting its child's items, which use the module: no circle; a use
        # of the child's items in the module's own code is one.
        with open(os.path.join(d, "src", "c.rs"), "w") as fh:
            fh.write("mod inner;\npub use inner::Q;\npub struct P;\n")
        with open(os.path.join(d, "src", "c", "inner.rs"), "w") as fh:
            fh.write("use super::P;\npub struct Q(P);\n")
        assert cycles(graph(d)) == [], cycles(graph(d))
        with open(os.path.join(d, "src", "c.rs"), "w") as fh:
            fh.write("mod inner;\npub use inner::Q;\npub struct P;\nfn g(_: inner::Q) {}\n")
        assert cycles(graph(d)) == [[("c",), ("c", "inner")]], cycles(graph(d))
    assert blank("let s = '\"'; // x\nlet t = r#\"a\"#;") == "let s =    ;     \nlet t =       ;"
    print("check_module_cycles: self-test passed")


def main(argv):
    """Checks each crate folder given; --report lists without failing."""
    if argv[:1] == ["--self-test"]:
        self_test()
        return 0
    report = "--report" in argv
    show = "--graph" in argv
    crates = [a for a in argv if not a.startswith("--")]
    if not crates:
        print(__doc__)
        return 2
    failed = False
    for crate in crates:
        edges = graph(crate)
        if show:
            for a in sorted(edges):
                print(f"{crate}: {name(a)} -> " + ", ".join(name(b) for b in sorted(edges[a])))
        found = cycles(edges)
        for group in found:
            print(f"{crate}: circle: {describe(group, edges)}")
        if not found:
            print(f"{crate}: {len(edges)} files, no circle")
        failed |= bool(found) and not report
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
