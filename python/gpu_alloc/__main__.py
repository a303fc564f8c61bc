"""The command line: ``python -m gpu_alloc doctor``, ``python -m gpu_alloc advise
SNAPSHOT.pickle`` and ``python -m gpu_alloc version`` (also installed as the ``gpu-alloc``
command)."""

import argparse
import os
import sys


def _parser(prog):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="gpu_alloc: a caching allocator as PyTorch's CUDA allocator (and CuPy's "
        "and Numba's). The same commands: python -m gpu_alloc COMMAND or gpu-alloc COMMAND.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="say what this machine can do with gpu_alloc, each problem with its fix "
        "(exit status 1 while the PyTorch path does not work)",
        description="Checks the library, the NVIDIA driver, the GPUs, torch, the C++ bridge "
        "and $GPUALLOC_CONF; each line is ok, problem (with its fix) or note. Exit status 0 "
        "when gpu_alloc.enable() would work, 1 otherwise.",
    )
    doctor.add_argument("--so", metavar="PATH", help="check this liballoc_ffi.so instead of "
                        "the one gpu_alloc finds")
    doctor.add_argument("--no-build", action="store_true", help="do not build the C++ bridge "
                        "(a first build takes about a minute)")
    advise = commands.add_parser(
        "advise",
        help="which allocator setting for your workload, from its memory snapshot",
        description="Replays a torch.cuda.memory._dump_snapshot() pickle (recorded with "
        "torch.cuda.memory._record_memory_history()) under PyTorch's default and expandable "
        "segments and gpu_alloc's settings on a simulated device (no GPU needed), and prints "
        "the predicted peak reserved memory of each, the recommended gpu_alloc.enable(...) "
        "call and its cost in page moves per step. Exit status 1 when the file is not a "
        "snapshot with events.",
    )
    advise.add_argument("snapshot", metavar="SNAPSHOT", help="the pickle (or a trace file)")
    advise.add_argument("--device", type=int, metavar="N", help="the snapshot's device "
                        "(default: the first with events)")
    advise.add_argument("--budget", metavar="BYTES|NMiB|NGiB", help="the memory the workload "
                        "may use (default: the device's memory): the budget setting reclaims at "
                        "it, and settings that pass it are not recommended")
    advise.add_argument("--json", action="store_true", help="print the full advice as JSON")
    advise.add_argument("--so", metavar="PATH", help="the liballoc_ffi.so to use")
    version = commands.add_parser("version", help="print the library's version and path")
    version.add_argument("--so", metavar="PATH", help="the liballoc_ffi.so to ask")
    return parser


def main(argv=None):
    """Runs one command; returns its exit status."""
    launched_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = "python -m gpu_alloc" if launched_as in ("", "__main__.py", "-c") else launched_as
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from gpu_alloc import doctor

        return doctor.main(so_path=args.so, build=not args.no_build)
    if args.command == "advise":
        import json

        import gpu_alloc

        try:
            advice = gpu_alloc.advise(
                args.snapshot, device=args.device, so_path=args.so, budget=args.budget
            )
        except (OSError, ValueError, gpu_alloc.GpuAllocError) as e:
            parser.exit(1, "%s advise: %s\n" % (prog, e))
        print(json.dumps(advice, indent=1) if args.json else advice["text"], end="")
        if args.json:
            print()
        return 0
    if args.command == "version":
        import gpu_alloc

        try:
            gpu_alloc.load_library(args.so)
            print("gpu_alloc %s, library %s" % (gpu_alloc.version(), gpu_alloc.library_path(args.so)))
        except gpu_alloc.GpuAllocError as e:
            parser.exit(1, "%s: %s\n" % (prog, e))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
