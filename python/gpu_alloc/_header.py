"""The C interface of liballoc_ffi.so as ctypes declarations, read from its header.

``gpualloc.h`` (crates/alloc-ffi/include/gpualloc.h, generated from crates/alloc-ffi/src/api.rs;
in a clone the package reads that file, and the wheel carries it next to this module) is the
one declaration of the library's functions, structs and constants: the C++ bridge includes it
(from ``HEADER_DIR``), and this module turns it into
ctypes ``restype`` / ``argtypes``, ``Structure`` classes and integer constants, so Python
cannot drift from it. The parser reads the subset of C that the generated header uses:
``#define NAME (integer)``, ``typedef struct X* name;`` (an opaque handle), function
pointer typedefs, ``typedef struct Name { type field; type field[N]; } Name;`` and
prototypes ``type name(type arg, ...);``. Anything else is an error, so that a header that
outgrows the parser fails the tests rather than being half read.

Strings follow the header's ownership rule: a returned ``char*`` is the caller's to free
with gpualloc_string_free, so it is kept as a ``c_void_p``; a returned ``const char*``
belongs to the library and reads as ``bytes``.
"""

import ctypes
import os
import re

HEADER_NAME = "gpualloc.h"
_HERE = os.path.dirname(os.path.abspath(__file__))
# The crate's header, when this package is python/gpu_alloc of a clone of the repository.
CRATE_HEADER = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "crates", "alloc-ffi",
                            "include", HEADER_NAME)
# The copy of it that the wheel carries (setup.py puts it there).
PACKAGED_HEADER = os.path.join(_HERE, HEADER_NAME)


def _header_path():
    """The crate's header in a clone, else the packaged copy."""
    for path in (CRATE_HEADER, PACKAGED_HEADER):
        if os.path.isfile(path):
            return path
    raise ImportError(
        "gpu_alloc: %s is missing (looked at %s and %s): install the package from its wheel "
        "or with `pip install .` in a clone, which put it there"
        % (HEADER_NAME, CRATE_HEADER, PACKAGED_HEADER)
    )


HEADER_PATH = _header_path()
# The folder to add to the include path of C and C++ code that includes gpualloc.h.
HEADER_DIR = os.path.dirname(HEADER_PATH)

# Scalar C types by name.
_SCALARS = {
    "int": ctypes.c_int,
    "double": ctypes.c_double,
    "size_t": ctypes.c_size_t,
    "ssize_t": ctypes.c_ssize_t,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "char": ctypes.c_char,
}

_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_DEFINE = re.compile(r"^\s*#define\s+(\w+)\s+\((-?\d+)\)[ \t]*$", re.M)
_PREPROCESSOR = re.compile(r"^\s*#.*$", re.M)
_EXTERN_C = re.compile(r'extern\s+"C"\s*\{|^\s*\}\s*$', re.M)
_STRUCT = re.compile(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
_OPAQUE = re.compile(r"^typedef\s+struct\s+\w+\s*\*\s*(\w+)$")
_CALLBACK = re.compile(r"^typedef\s+(.+?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)$", re.S)
_PROTOTYPE = re.compile(r"^(.+?)\b(\w+)\s*\((.*)\)$", re.S)
_FIELD = re.compile(r"^(.+?)\b(\w+)\s*(?:\[(\d+)\])?$", re.S)


class Header:
    """What a header declares: ``constants`` {name: int}, ``structs`` {name: ctypes
    Structure}, ``functions`` {name: (restype, argtypes)}, and ``types`` {name: ctypes
    type} for every named type it defines."""

    def __init__(self):
        self.constants = {}
        self.structs = {}
        self.functions = {}
        self.types = {}


def _normalize(text):
    """A C type with single spaces and the stars attached: ``const uint64_t*``."""
    return re.sub(r"\s*\*\s*", "*", re.sub(r"\s+", " ", text).strip())


def _ctype(spelling, header):
    """The ctypes type of a C type spelling (None for void)."""
    t = _normalize(spelling)
    if t == "void":
        return None
    if t in ("const char*", "char*"):
        # A returned char* is owned by the caller (freed with gpualloc_string_free), so
        # its address is kept; a char* argument is such a string passed back.
        return ctypes.c_char_p if t == "const char*" else ctypes.c_void_p
    if t in ("void*", "const void*"):
        return ctypes.c_void_p
    if t.endswith("*"):
        return ctypes.POINTER(_ctype(t[:-1], header))
    t = t[len("const "):] if t.startswith("const ") else t
    if t in header.types:
        return header.types[t]
    if t in _SCALARS:
        return _SCALARS[t]
    raise ValueError("gpualloc.h: no ctypes mapping for the C type %r" % spelling)


def _params(text, header):
    """The ctypes types of a parameter list (``void`` or ``type name, ...``)."""
    text = text.strip()
    if text in ("", "void"):
        return []
    types = []
    for param in text.split(","):
        m = _FIELD.match(param.strip())
        if m is None or m.group(3) is not None:
            raise ValueError("gpualloc.h: cannot read the parameter %r" % param)
        types.append(_ctype(m.group(1), header))
    return types


def _struct(name, body, header):
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        m = _FIELD.match(decl)
        if m is None:
            raise ValueError("gpualloc.h: cannot read the field %r of %s" % (decl, name))
        ty = _ctype(m.group(1), header)
        fields.append((m.group(2), ty * int(m.group(3)) if m.group(3) else ty))
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def parse(text):
    """The declarations of a header's text (see the module's docstring)."""
    header = Header()
    code = _COMMENT.sub(" ", text)
    for name, value in _DEFINE.findall(code):
        header.constants[name] = int(value)
    code = _PREPROCESSOR.sub(" ", code)
    code = _EXTERN_C.sub(" ", code)

    def struct(m):
        name, body, alias = m.groups()
        if name != alias:
            raise ValueError("gpualloc.h: struct %s is typedef'd as %s" % (name, alias))
        header.structs[name] = header.types[name] = _struct(name, body, header)
        return " "

    # Structs first, in order, so that later declarations can name them.
    code = _STRUCT.sub(struct, code)
    for statement in code.split(";"):
        statement = re.sub(r"\s+", " ", statement).strip()
        if not statement:
            continue
        opaque = _OPAQUE.match(statement)
        callback = _CALLBACK.match(statement)
        prototype = _PROTOTYPE.match(statement)
        if opaque:
            header.types[opaque.group(1)] = ctypes.c_void_p
        elif callback:
            ret, name, params = callback.groups()
            header.types[name] = ctypes.CFUNCTYPE(
                _ctype(ret, header), *_params(params, header)
            )
        elif prototype and not statement.startswith("typedef"):
            ret, name, params = prototype.groups()
            header.functions[name] = (_ctype(ret, header), _params(params, header))
        else:
            raise ValueError("gpualloc.h: cannot read %r" % statement)
    return header


def load(path=HEADER_PATH):
    """The declarations of the header file at ``path`` (default: the packaged one)."""
    with open(path) as f:
        return parse(f.read())


def declare(lib, header):
    """Sets ``restype`` and ``argtypes`` of every function of ``header`` that ``lib`` (a
    ctypes.CDLL) exports, and returns the names it lacks (an older library: those stay
    undeclared, and using one raises AttributeError)."""
    missing = []
    for name, (restype, argtypes) in header.functions.items():
        try:
            f = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        f.restype = restype
        f.argtypes = argtypes
    return missing
