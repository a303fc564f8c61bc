#!/usr/bin/env python3
"""Where `unmap_free_pages`' page moves come from, offline.

Reads block placements (the `placements` example of alloc-replay: one line per
event, `a ADDR SIZE REQUESTED` or `f ADDR SIZE`) or a trace, and answers:

  rounds PLACEMENTS SPEC[,SPEC...]
      The engine's rule on these placements: before a mapping would raise the
      mapped bytes above their peak, unmap whole free pages, highest address
      first, just enough. SPEC is `uniform:MIB` (every page MIB MiB, as
      `unmap_page_mb`) or `mixed:MIB` (a page of MIB MiB where the block being
      mapped covers a whole aligned one, 2 MiB granules elsewhere). Prints the
      peak mapped bytes and the pages unmapped.
  choice PLACEMENTS MIB
      The same placements with the mapped bytes capped at the bound (the peak
      of pages under live blocks), and which free pages a round unmaps: the
      highest addresses, the least recently freed, or those used again
      furthest in the future (Belady's choice, the fewest moves possible for
      these placements). Prints the pages unmapped by each.
  pack TRACE
      The span of the trace's blocks (sizes rounded to 512 B) laid out offline
      with full knowledge of their lifetimes (largest first, each at the lowest
      offset free for its whole life) against the peak of live bytes: how
      close a layout planned from the requests can get with no page moves.
  place TRACE OUT VARIANT [MIB]
      Best fit with coalescing over one growable segment per pool (a model of
      `expandable_segments:True`), writing placements to OUT. VARIANT `best`
      carves blocks from the front of the best fit, `back` carves blocks of at
      least MIB MiB from its end.
"""

import bisect
import collections
import gzip
import sys

MIB = 1 << 20
GRANULE = 2 * MIB


def read_placements(path):
    """Events as (is_alloc, addr, size, requested)."""
    events = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if p[0] == "a":
                events.append((True, int(p[1]), int(p[2]), int(p[3])))
            else:
                events.append((False, int(p[1]), int(p[2]), 0))
    return events


def read_trace(path):
    """Trace events as (kind, id, requested bytes); `#` lines skipped."""
    opener = gzip.open if path.endswith(".gz") else open
    events = []
    with opener(path, "rt") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            p = line.split()
            events.append((p[0], p[1], int(p[2]) if p[0] == "a" else 0))
    return events


def rounded(size):
    return 512 if size < 512 else (size + 511) // 512 * 512


def granules(addr, size):
    return range(addr // GRANULE, (addr + size - 1) // GRANULE + 1)


ZONE_ALIGN = 16 << 30  # growable segments' ranges start on such a boundary in replay
ZONED_RATIO = 512  # as unmap_page_mb:auto


def zoned_granules(g, ratio, largest):
    """Granules per page at granule `g` in `zoned` mode: the largest power of
    two of 2 MiB granules at most 1/`ratio` of the segment below the page,
    at least one, at most `largest` granules."""
    below = g * GRANULE % ZONE_ALIGN
    n = max(1, below // ratio // GRANULE)
    return min(1 << (n.bit_length() - 1), largest)


def rounds(events, mode, page):
    """Peak mapped bytes and pages unmapped under the engine's round rule."""
    per = page // GRANULE
    users = collections.Counter()  # granule -> live blocks over it
    page_at = {}  # mapped granule -> start granule of its page
    pages = {}  # start granule -> granules in the page
    mapped = peak = unmapped = 0
    for is_alloc, addr, size, _ in events:
        span = granules(addr, size)
        if not is_alloc:
            for g in span:
                users[g] -= 1
            continue
        need = []
        g = span.start
        while g < span.stop:
            if mode == "zoned":
                per = zoned_granules(g, ZONED_RATIO, page // GRANULE)
            start = g // per * per
            if mode in ("uniform", "zoned"):
                if start not in pages:
                    need.append((start, per))
                g = start + per
            elif g in page_at:
                g += 1
            elif (g == start and start * GRANULE >= addr
                  and (start + per) * GRANULE <= addr + size
                  and not any(x in page_at for x in range(start, start + per))):
                need.append((start, per))
                g = start + per
            else:
                need.append((g, 1))
                g += 1
        for g in span:
            users[g] += 1
        extra = sum(n for _, n in need) * GRANULE
        if mapped + extra > peak:
            over = mapped + extra - peak
            for start in sorted(pages, reverse=True):
                if over <= 0:
                    break
                n = pages[start]
                if all(users[x] == 0 for x in range(start, start + n)):
                    del pages[start]
                    for x in range(start, start + n):
                        del page_at[x]
                    mapped -= n * GRANULE
                    over -= n * GRANULE
                    unmapped += 1
        for start, n in need:
            pages[start] = n
            for x in range(start, start + n):
                page_at[x] = start
        mapped += extra
        peak = max(peak, mapped)
    return peak, unmapped


def choice(events, page, rule):
    """Pages unmapped with the mapped pages capped at the bound."""
    def pages_of(addr, size):
        return range(addr // page, (addr + size - 1) // page + 1)
    users = collections.Counter()
    uses = collections.defaultdict(list)  # page -> times it becomes used
    bound = 0
    for t, (is_alloc, addr, size, _) in enumerate(events):
        for p in pages_of(addr, size):
            if is_alloc:
                if users[p] == 0:
                    uses[p].append(t)
                users[p] += 1
            else:
                users[p] -= 1
                if users[p] == 0:
                    del users[p]
        bound = max(bound, len(users))
    users = collections.Counter()
    seen = collections.Counter()  # uses consumed per page
    freed_at = {}
    mapped = set()
    unmapped = 0
    for t, (is_alloc, addr, size, _) in enumerate(events):
        span = pages_of(addr, size)
        if not is_alloc:
            for p in span:
                users[p] -= 1
                if users[p] == 0:
                    freed_at[p] = t
            continue
        new = [p for p in span if p not in mapped]
        for p in span:
            if users[p] == 0:
                seen[p] += 1
            users[p] += 1
        over = len(mapped) + len(new) - bound
        if over > 0:
            free = [p for p in mapped if users[p] == 0]
            if rule == "highest":
                free.sort(reverse=True)
            elif rule == "oldest-freed":
                free.sort(key=lambda p: freed_at.get(p, -1))
            else:  # belady: next use furthest away first
                def next_use(p):
                    u = uses[p]
                    return u[seen[p]] if seen[p] < len(u) else len(events)
                free.sort(key=next_use, reverse=True)
            for p in free[:over]:
                mapped.discard(p)
                unmapped += 1
        mapped.update(new)
    return bound * page, unmapped


def pack(trace_events):
    """(span of an offline layout, peak live bytes) of a trace's blocks."""
    born, size, died = {}, {}, {}
    live = peak = 0
    for t, (kind, ident, requested) in enumerate(trace_events):
        if kind == "a":
            born[ident], size[ident] = t, rounded(max(requested, 1))
            live += size[ident]
            peak = max(peak, live)
        elif ident in size and ident not in died:
            died[ident] = t
            live -= size[ident]
    end = len(trace_events)
    # Largest first, equal sizes in allocation order.
    blocks = sorted(((size[i], born[i], died.get(i, end)) for i in born), key=lambda b: (-b[0], b[1]))
    placed = []  # (start, end, offset, size)
    span = 0
    for z, s, e in blocks:
        offset = 0
        for lo, hi in sorted((o, o + zz) for ss, ee, o, zz in placed if ss < e and s < ee):
            if offset + z <= lo:
                break
            offset = max(offset, hi)
        placed.append((s, e, offset, z))
        span = max(span, offset + z)
    return span, peak


class Growable:
    """One growable segment: address-ordered blocks, free ones by (size, addr)."""

    def __init__(self, base, step):
        self.end, self.step = base, step
        self.by_size = []  # (size, addr) of free blocks
        self.blocks = {}  # addr -> [size, free]
        self.addrs = []  # block addresses in order

    def _index(self, addr, size):
        bisect.insort(self.by_size, (size, addr))

    def _unindex(self, addr):
        del self.by_size[bisect.bisect_left(self.by_size, (self.blocks[addr][0], addr))]

    def _add(self, addr, size, free):
        self.blocks[addr] = [size, free]
        bisect.insort(self.addrs, addr)
        if free:
            self._index(addr, size)

    def _drop(self, addr):
        del self.blocks[addr]
        del self.addrs[bisect.bisect_left(self.addrs, addr)]

    def alloc(self, size, variant, back_min):
        i = bisect.bisect_left(self.by_size, (size, -1))
        if i == len(self.by_size):
            last = self.addrs[-1] if self.addrs else None
            tail = self.blocks[last][0] if last is not None and self.blocks[last][1] else 0
            extra = (size - tail + self.step - 1) // self.step * self.step
            if tail:
                self._unindex(last)
                self.blocks[last][0] += extra
                self._index(last, self.blocks[last][0])
            else:
                self._add(self.end, extra, True)
            self.end += extra
            i = bisect.bisect_left(self.by_size, (size, -1))
        have, addr = self.by_size.pop(i)
        if have == size:
            self.blocks[addr][1] = False
            return addr
        if variant == "back" and size >= back_min:
            self.blocks[addr][0] = have - size
            self._index(addr, have - size)
            self._add(addr + have - size, size, False)
            return addr + have - size
        self.blocks[addr] = [size, False]
        self._add(addr + size, have - size, True)
        return addr

    def free(self, addr):
        size = self.blocks[addr][0]
        self.blocks[addr][1] = True
        i = bisect.bisect_left(self.addrs, addr)
        if i + 1 < len(self.addrs):
            nxt = self.addrs[i + 1]
            if self.blocks[nxt][1]:
                self._unindex(nxt)
                size += self.blocks[nxt][0]
                self._drop(nxt)
                self.blocks[addr][0] = size
        if i > 0:
            prev = self.addrs[i - 1]
            if self.blocks[prev][1]:
                self._unindex(prev)
                self.blocks[prev][0] += size
                self._drop(addr)
                addr, size = prev, self.blocks[prev][0]
        self._index(addr, size)


def place(trace_events, variant, back_min, out):
    """Best-fit placements of a trace (small pool <= 1 MiB, large pool)."""
    pools = {False: Growable(0, 2 * MIB), True: Growable(1 << 44, 16 * MIB)}
    live = {}
    for kind, ident, requested in trace_events:
        if kind == "a":
            size = rounded(max(requested, 1))
            large = size > MIB
            addr = pools[large].alloc(size, variant, back_min)
            live[ident] = (large, addr, size)
            out.write(f"a {addr} {size} {requested}\n")
        elif ident in live:
            large, addr, size = live.pop(ident)
            pools[large].free(addr)
            out.write(f"f {addr} {size}\n")


def main(argv):
    if len(argv) < 2 or argv[0] not in ("rounds", "choice", "pack", "place"):
        sys.exit(__doc__)
    command, path = argv[0], argv[1]
    if command == "rounds":
        events = read_placements(path)
        for spec in argv[2].split(","):
            mode, mib = spec.split(":")
            peak, unmapped = rounds(events, mode, int(mib) * MIB)
            print(f"{spec}: peak {peak / MIB:.0f} MiB, {unmapped} pages unmapped")
    elif command == "choice":
        events = read_placements(path)
        for rule in ("highest", "oldest-freed", "belady"):
            bound, unmapped = choice(events, int(argv[2]) * MIB, rule)
            print(f"{rule}: bound {bound / MIB:.0f} MiB, {unmapped} pages unmapped")
    elif command == "pack":
        span, peak = pack(read_trace(path))
        print(f"layout span {span / MIB:.0f} MiB, peak live {peak / MIB:.0f} MiB, "
              f"ratio {span / peak:.4f}")
    else:
        back_min = int(argv[4]) * MIB if len(argv) > 4 else 0
        with open(argv[2], "w") as out:
            place(read_trace(path), argv[3], back_min, out)


if __name__ == "__main__":
    main(sys.argv[1:])
