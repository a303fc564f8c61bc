#!/usr/bin/env bash
# CI for the Python package gpu_alloc, both ways of installing it:
# 1. the manylinux wheel (setup.py with cargo-zigbuild against glibc 2.17, as shipped to GPU
#    machines without Rust) into .whl/, checked for its files, its tag, that it holds no cffi
#    module and that the library does not link libcuda; installed into a fresh virtual
#    environment, where the CPU tests and `python -m gpu_alloc doctor` run against the
#    installed package from outside the clone;
# 2. `pip install .` from the clone (setuptools as the PEP 517 backend) into another one.
# Needs python3 with venv, cargo, binutils' readelf and PyPI; no GPU, no torch.
set -euxo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

# The wheel, built in an environment that has cargo-zigbuild and zig (the ziglang package).
python3 -m venv "$SCRATCH/build"
"$SCRATCH/build/bin/pip" install --quiet --disable-pip-version-check "setuptools>=77" \
    cargo-zigbuild ziglang
mkdir -p .whl
rm -f .whl/gpu_alloc-*.whl
PATH="$SCRATCH/build/bin:$PATH" GPUALLOC_WHEEL_GLIBC=2.17 "$SCRATCH/build/bin/pip" wheel \
    --quiet --disable-pip-version-check --no-build-isolation --no-deps -w .whl .
WHEEL=$(echo "$REPO"/.whl/gpu_alloc-*-py3-none-manylinux*_x86_64.whl)
test -f "$WHEEL"
"$SCRATCH/build/bin/python" - "$WHEEL" "$SCRATCH/lib.so" "$REPO/python" <<'EOF'
"""The wheel holds every file of the package (the bridge's sources included), the library
and the crate's header beside them, and no cffi module (ctypes is the one way the package
calls the library); the library does not link libcuda."""
import os, subprocess, sys, zipfile
wheel, extracted, python_dir = sys.argv[1:]
archive = zipfile.ZipFile(wheel)
names = set(archive.namelist())
sources = sorted(
    os.path.relpath(os.path.join(d, f), python_dir)
    for d, _, files in os.walk(os.path.join(python_dir, "gpu_alloc"))
    if "__pycache__" not in d
    for f in files if not f.endswith(".pyc"))
for name in sources + ["gpu_alloc/liballoc_ffi.so", "gpu_alloc/gpualloc.h"]:
    assert name in names, "%s is not in the wheel: %s" % (name, sorted(names))
packaged = {n for n in names if n.startswith("gpu_alloc/")}
assert packaged == set(sources) | {"gpu_alloc/liballoc_ffi.so", "gpu_alloc/gpualloc.h"}, \
    sorted(packaged - set(sources))
header = open(os.path.join(python_dir, "..", "crates", "alloc-ffi", "include", "gpualloc.h"),
              "rb").read()
assert archive.read("gpu_alloc/gpualloc.h") == header, "the packaged header is the crate's"
metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
assert all('extra == "torch"' in line for line in requires), requires
with open(extracted, "wb") as f:
    f.write(archive.read("gpu_alloc/liballoc_ffi.so"))
needed = subprocess.run(["readelf", "-d", extracted], check=True, capture_output=True, text=True).stdout
assert "libcuda" not in needed, needed
symbols = subprocess.run(["readelf", "-W", "--dyn-syms", extracted], check=True, capture_output=True, text=True).stdout
for symbol in ["gpualloc_malloc", "gpualloc_free", "gpualloc_version", "gpualloc_advise",
               "gpualloc_host_register"]:
    assert " %s\n" % symbol in symbols, symbol
print("wheel ok: %d files, library links no libcuda" % len(names))
EOF

# The wheel installed, tested from outside the clone.
python3 -m venv "$SCRATCH/wheel"
"$SCRATCH/wheel/bin/pip" install --quiet --disable-pip-version-check "$WHEEL"
cd "$SCRATCH"
GPUALLOC_TEST_INSTALLED=1 "$SCRATCH/wheel/bin/python" "$REPO/python/tests/test_cpu.py"
GPUALLOC_TEST_INSTALLED=1 "$SCRATCH/wheel/bin/python" "$REPO/python/tests/test_doctor.py"
GPUALLOC_TEST_INSTALLED=1 "$SCRATCH/wheel/bin/python" "$REPO/python/tests/test_advise.py"
GPUALLOC_TEST_INSTALLED=1 "$SCRATCH/wheel/bin/python" "$REPO/python/tests/test_libraries.py"
"$SCRATCH/wheel/bin/python" -m gpu_alloc advise "$REPO/traces/small_mlp.snapshot.pickle" | grep "^recommended: "
"$SCRATCH/wheel/bin/python" -m gpu_alloc version
"$SCRATCH/wheel/bin/gpu-alloc" --help
# Exit status 1 on a machine without a GPU (0 where everything works); a crash fails CI.
status=0
"$SCRATCH/wheel/bin/python" -m gpu_alloc doctor >doctor.txt 2>&1 || status=$?
cat doctor.txt
test "$status" -le 1
if grep -q Traceback doctor.txt; then exit 1; fi
grep -q "^summary: " doctor.txt

# pip install . from the clone.
python3 -m venv "$SCRATCH/source"
"$SCRATCH/source/bin/pip" install --quiet --disable-pip-version-check "$REPO"
"$SCRATCH/source/bin/python" -c '
import gpu_alloc, sys
path = gpu_alloc.library_path()
assert path.startswith(sys.prefix), path
print(path, gpu_alloc.version())
'
