"""Builds the wheel of gpu_alloc (pyproject.toml has the project's metadata): the Python
package python/gpu_alloc with the C library liballoc_ffi.so, built here by cargo, and its
header crates/alloc-ffi/include/gpualloc.h next to its modules, where the package looks for
both. The library is loaded with ctypes, not imported, so the wheel is tagged
py3-none-<platform>: one wheel for every Python 3 on that platform.

GPUALLOC_WHEEL_GLIBC=2.17 (or another glibc version) builds the library with
`cargo zigbuild` against that glibc and tags the wheel manylinux_2_17, for machines without
Rust; cargo-zigbuild and ziglang (both on PyPI) must be in the build environment.
"""

import os
import platform
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "liballoc_ffi.so"
HEADER = os.path.join("crates", "alloc-ffi", "include", "gpualloc.h")
GLIBC = os.environ.get("GPUALLOC_WHEEL_GLIBC", "").strip()


def build_library():
    """cargo's release build of liballoc_ffi.so (line tables left out: they would make most
    of its size); returns the library's path."""
    target_dir = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    args = ["build", "--release", "-p", "alloc-ffi", "--config", "profile.release.debug=0"]
    out = os.path.join(target_dir, "release")
    if GLIBC:
        triple = "%s-unknown-linux-gnu" % platform.machine()
        args = ["zigbuild"] + args[1:] + ["--target", "%s.%s" % (triple, GLIBC)]
        out = os.path.join(target_dir, triple, "release")
    subprocess.run(["cargo"] + args, cwd=ROOT, check=True)
    return os.path.join(out, LIBRARY)


class BuildPy(build_py):
    """The package's modules, then the library and the header beside them."""

    def run(self):
        super().run()
        if self.editable_mode:
            # An editable install is the clone's package, which finds cargo's target/ and
            # the crate's header itself.
            return
        package = os.path.join(self.build_lib, "gpu_alloc")
        # Copied whatever the times: a library built for another glibc may be older than
        # the one a previous build left here.
        shutil.copy(build_library(), os.path.join(package, LIBRARY))
        shutil.copy(os.path.join(ROOT, HEADER), os.path.join(package, "gpualloc.h"))


class NativeDistribution(Distribution):
    """Carries a native library: a platform wheel, installed to the platform's folder."""

    def has_ext_modules(self):
        return True


class BdistWheel(bdist_wheel):
    """A platform wheel for any Python 3 (the library is not a CPython extension)."""

    def get_tag(self):
        plat = super().get_tag()[2]
        if GLIBC:
            plat = "manylinux_%s_%s" % (GLIBC.replace(".", "_"), platform.machine())
        return "py3", "none", plat


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
