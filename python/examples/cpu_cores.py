"""CPU lists that share no physical core, read from the host's topology (Linux sysfs):

    cores_apart(2, 8)  ->  [[2, 3, 4, 5, 6, 7, 8, 9], [10, 11, ...]]

Two processes timed side by side, or two ranks of one job, that are pinned to CPU lists
sharing a core (hyperthread siblings: CPU k and k+16 on a host of 16 cores and 32 threads)
slow each other in a way that depends on what the other one runs; lists built here take
one logical CPU of each core, each core in at most one list, and leave the host's first
cores (the parent, the system) out. `--cpus apart:N` (compare_workloads.py) and
`--rank-cpus apart:N` (benchmarks/fsdp/rounds.py) ask for them.
"""
import collections
import os

SYSFS = "/sys/devices/system/cpu"
APART = "apart:"


def core_of(cpu, root=SYSFS):
    """(package, core) of a logical CPU; (0, cpu) where the host does not say."""
    top = os.path.join(root, "cpu%d" % cpu, "topology")
    try:
        with open(os.path.join(top, "physical_package_id")) as f:
            package = int(f.read())
        with open(os.path.join(top, "core_id")) as f:
            return package, int(f.read())
    except (OSError, ValueError):
        return 0, cpu


def cores_apart(count, per, allowed=None, skip=1, root=SYSFS):
    """`count` lists of `per` logical CPUs, one CPU a physical core and no core in two
    lists, from the CPUs this process may run on (`allowed`), leaving out the first `skip`
    cores. Raises ValueError when the host has too few cores."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    first_cpu = {}
    for cpu in allowed:
        first_cpu.setdefault(core_of(cpu, root), cpu)
    cpus = sorted(first_cpu.values())[skip:]
    if count < 1 or per < 1 or len(cpus) < count * per:
        raise ValueError("%d lists of %d cores apart need %d physical cores; this host "
                         "offers %d (after the first %d)" % (count, per, count * per,
                                                             len(cpus), skip))
    return [cpus[i * per:(i + 1) * per] for i in range(count)]


# 'apart:N' as parsed: lists of N cores apart, their number known once the runs are.
Apart = collections.namedtuple("Apart", "per")


def parse_apart(text):
    """Apart(N) for 'apart:N', None for any other text; ValueError for a bad N."""
    if not text.strip().startswith(APART):
        return None
    per = int(text.strip()[len(APART):])
    if per < 1:
        raise ValueError("apart:N needs N >= 1")
    return Apart(per)


def format_cpus(cpus):
    """'2,3,4' for taskset -c."""
    return ",".join(str(c) for c in cpus)
