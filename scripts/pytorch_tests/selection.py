"""Which of PyTorch's own tests run.py runs, and in which groups (no torch needed here).

A plan is a list of chunks. A chunk is one test file and some of its test classes; each
chunk runs in a process of its own per mode (one process per chunk keeps a crash or a
poisoned CUDA context from spreading to other classes, at the cost of one `import torch`
and one CUDA start per chunk). A class is named as in the source; PyTorch's
`instantiate_device_type_tests` renames `TestFoo` to `TestFooCUDA`, which `class_matches`
accepts. Within a class, `include` / `exclude` are regular expressions searched in the
test method's name (parametrized names included, e.g. `test_graph_optims_Adam_cuda_float32`).

The chunks come in priority order: under a time budget the first ones are the ones that
say the most about an allocator.
"""
import re

# Allocator-related test methods of TestCuda: memory, stats, OOM, memory fraction,
# record_stream, cross-stream autograd, CUDA graphs and their pools. The pinned-memory
# tests exercise PyTorch's host allocator, which a CUDA allocator does not replace.
TEST_CUDA_INCLUDE = (
    r"memory|caching_allocator|allocator|stats|snapshot|record_stream|graph|mempool|pool|"
    r"empty_cache|oom|out_of_memory|expandable|fraction|cublas_workspace|"
    r"streaming_backwards|leak"
)
TEST_CUDA_EXCLUDE = r"pinned|host_memory|cudaregister|cudart_register|batch_norm"

DEFAULT_PLAN = [
    {
        "name": "mempool",
        "file": "test_cuda.py",
        "classes": {"TestMemPool": {}},
    },
    {
        "name": "memory",
        "file": "test_cuda.py",
        # Snapshots, memory history, allocator settings, raw_alloc, OOM observers, the
        # allocator fuzz; not the NVML / AMD SMI queries, which never reach an allocator.
        "classes": {
            "TestCudaMallocAsync": {
                "exclude": r"nvml|temperature|power_draw|clock_speed|amdsmi|uuid_visible|"
                r"direct_traceback",
            }
        },
    },
    {
        "name": "cuda",
        "file": "test_cuda.py",
        "classes": {"TestCuda": {"include": TEST_CUDA_INCLUDE, "exclude": TEST_CUDA_EXCLUDE}},
    },
    {
        "name": "ipc",
        "file": "test_multiprocessing.py",
        # CUDA tensors, events and parameters shared with other processes (CUDA IPC).
        "classes": {
            "TestMultiprocessing": {"include": r"cuda|event|ipc|leaf_variable_sharing"},
        },
    },
    {
        "name": "graphs",
        "file": "test_cuda.py",
        "classes": {
            # Checkpointing of a graph pool's state (torch.compile's CUDA graph trees).
            "TestBlockStateAbsorption": {"exclude": r"no_triton_on_import"},
            # Graph capture with device tensors next to pinned host memory.
            "TestCachingHostAllocatorCudaGraph": {},
            "TestCudaDeviceParametrized": {},
            # Memory snapshots augmented with FX traces (torch.compile, aot_eager).
            "TestFXMemoryProfiler": {},
        },
    },
    {
        "name": "optims",
        "file": "test_cuda.py",
        # Capturable optimizers and grad scaling captured in CUDA graphs.
        "classes": {"TestCudaOptims": {"include": r"^test_graph_"}},
    },
]


def class_matches(spec_name, class_name):
    """`TestFoo` names the class TestFoo and its device-type instantiations (TestFooCUDA)."""
    if class_name == spec_name:
        return True
    rest = class_name[len(spec_name):]
    return class_name.startswith(spec_name) and rest.isalpha() and rest.isupper()


def method_selected(rules, method):
    """Whether a test method passes a class's include / exclude rules."""
    include = rules.get("include")
    exclude = rules.get("exclude")
    if include and not re.search(include, method):
        return False
    if exclude and re.search(exclude, method):
        return False
    return True


def test_id(file, class_name, method):
    """The id under which results are kept and reported: `test_cuda.py::TestMemPool::test_x`."""
    return "%s::%s::%s" % (file, class_name, method)


def split_id(tid):
    """(file, class, method) of a test id."""
    file, cls, method = tid.split("::", 2)
    return file, cls, method


def select(chunk, available, keywords=(), all_tests=False):
    """The test ids of `chunk` to run, in order, from `available`: (class, method) pairs
    found in the chunk's file. `keywords` (-k) are regular expressions, any of which must
    be found in the test id; `all_tests` ignores the include / exclude rules."""
    chosen = []
    for class_name, method in available:
        for spec_name, rules in chunk["classes"].items():
            if not class_matches(spec_name, class_name):
                continue
            if not all_tests and not method_selected(rules, method):
                continue
            tid = test_id(chunk["file"], class_name, method)
            if keywords and not any(re.search(k, tid) for k in keywords):
                continue
            chosen.append(tid)
            break
    return chosen


def chunk_files(plan):
    """The test files a plan needs, in order of first use."""
    seen = []
    for chunk in plan:
        if chunk["file"] not in seen:
            seen.append(chunk["file"])
    return seen
