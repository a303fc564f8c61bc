"""The command line: ``python -m gpu_alloc doctor`` and ``python -m gpu_alloc version``
(also installed as the ``gpu-alloc`` command)."""

import argparse
import os
import sys


def _parser(prog):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="gpu_alloc: the gpualloc caching allocator as PyTorch's CUDA allocator.",
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
