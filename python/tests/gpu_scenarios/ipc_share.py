"""GPU scenario: CUDA tensors shared between processes (torch.multiprocessing, spawn)
under the gpu_alloc bridge, in PyTorch 2.11's IPC handle format, with either side running
gpualloc or PyTorch's allocator.

    GPUALLOC_SO=target/release/liballoc_ffi.so python3 python/tests/gpu_scenarios/ipc_share.py [CASE...]

Each case runs in a process of its own (the sender; an allocator is chosen once per
process), which spawns the receiver. The sender allocates a tensor at an offset inside its
segment (spanning several pages when the segment is expandable) and a second one after it
in the same segment, and sends both; the receiver reads them (one mapping for both when
they share a handle), writes new values, and the sender sees them; the sender then drops
its tensor while the receiver holds its view and allocates the same size again: the block
must not be handed out again (a new address, the receiver's view intact); once the
receiver let go, torch.cuda.ipc_collect() frees the blocks (allocated bytes back to where
they were). Cases, as sender -> receiver (config):
  gpualloc -> gpualloc / torch         default config: 'c' handles (cudaIpcGetMemHandle)
  gpualloc_e -> gpualloc / torch       expandable_segments:True: 'e' handles (POSIX fds)
  gpualloc_u -> torch                  expandable, unmap_free_pages: 8 MiB pages
  torch -> gpualloc, torch_e -> gpualloc   PyTorch's allocator sending ('c', 'e')
  torch -> torch, torch_e -> torch     references: PyTorch on both sides
An 'e' handle is opened with pidfd_getfd on the sender, which needs ptrace permission over
it: with kernel.yama.ptrace_scope 1 the sender allows its receiver with
prctl(PR_SET_PTRACER, pid) (said in the case's line); with 2 or 3 such cases fail (also
under PyTorch alone: see the reference cases).
Prints one line per case and "RESULT ..." and exits 0, or exits 1 when a case failed.
"""
import ctypes
import gc
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/, for gpu_alloc

MIB = 1 << 20
PR_SET_PTRACER = 0x59616D61
TIMEOUT = 120

# Allocator settings of each side: (allocator, configuration).
SIDES = {
    "gpualloc": ("gpualloc", ""),
    "gpualloc_e": ("gpualloc", "expandable_segments:True"),
    "gpualloc_u": ("gpualloc", "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8"),
    "torch": ("torch", ""),
    "torch_e": ("torch", "expandable_segments:True"),
}

# Case name -> (sender side, receiver side).
CASES = {
    "gpualloc_to_gpualloc": ("gpualloc", "gpualloc"),
    "gpualloc_to_torch": ("gpualloc", "torch"),
    "gpualloc_e_to_gpualloc": ("gpualloc_e", "gpualloc"),
    "gpualloc_e_to_torch": ("gpualloc_e", "torch"),
    "gpualloc_u_to_torch": ("gpualloc_u", "torch"),
    "torch_to_gpualloc": ("torch", "gpualloc"),
    "torch_e_to_gpualloc": ("torch_e", "gpualloc"),
    "torch_to_torch": ("torch", "torch"),
    "torch_e_to_torch": ("torch_e", "torch"),
}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def use_allocator(side):
    """Makes `side`'s allocator this process's CUDA allocator; returns torch. Must run
    before torch allocates CUDA memory (and, for PyTorch's settings, before torch is
    imported)."""
    kind, config = SIDES[side]
    os.environ.pop("GPUALLOC_CONF", None)
    if kind == "torch":
        if config:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = config
        else:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import torch

        return torch
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import gpu_alloc

    gpu_alloc.enable(config or None, bridge=True)
    import torch

    check(gpu_alloc.uses_bridge(), "the gpu_alloc bridge is installed")
    return torch


def expected(torch, n, scale):
    return torch.arange(n, dtype=torch.float32, device="cuda") * scale + 1


def receiver(side, inbox, outbox):
    """The receiving process: opens the tensor, checks and writes it, holds it while the
    sender frees and reallocates, checks it again, lets go."""
    try:
        torch = use_allocator(side)
        torch.cuda.init()
        y, w, n, m = inbox.get(timeout=TIMEOUT)
        check(y.is_cuda and y.numel() == n, "received a CUDA tensor of %d elements" % n)
        torch.cuda.synchronize()
        check(torch.equal(y, expected(torch, n, 1)), "the receiver reads the sender's values")
        check(torch.equal(w, expected(torch, m, 3)), "the receiver reads the second tensor")
        y.copy_(expected(torch, n, 2))  # the sender must see these
        torch.cuda.synchronize()
        outbox.put(("written", (y.data_ptr(), w.data_ptr())))
        del w
        msg = inbox.get(timeout=TIMEOUT)
        check(msg == "check", "protocol: %r" % (msg,))
        torch.cuda.synchronize()
        intact = torch.equal(y, expected(torch, n, 2))
        del y
        gc.collect()
        torch.cuda.synchronize()
        outbox.put(("released", intact))
    except BaseException as e:  # reported by the sender
        outbox.put(("error", "%s: %s" % (type(e).__name__, str(e).strip()[-1500:])))


def allow_ptracer(pid):
    """With kernel.yama.ptrace_scope 1, lets `pid` duplicate this process's descriptors
    (pidfd_getfd for 'e' handles). Returns a note for the case's line."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return ""
    if scope == 0:
        return ""
    if scope == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PTRACER, pid, 0, 0, 0) != 0:
            return "; prctl(PR_SET_PTRACER) failed: %s" % os.strerror(ctypes.get_errno())
        return "; yama ptrace_scope 1: sender allowed the receiver (PR_SET_PTRACER)"
    return "; yama ptrace_scope %d: 'e' handles need CAP_SYS_PTRACE" % scope


def reply(outbox, want):
    tag, value = outbox.get(timeout=TIMEOUT)
    if tag == "error":
        raise AssertionError("receiver: " + value)
    check(tag == want, "protocol: expected %r, got %r" % (want, tag))
    return value


def run_case(name):
    send_side, recv_side = CASES[name]
    torch = use_allocator(send_side)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(recv_side, inbox, outbox), daemon=True)
    proc.start()
    note = allow_ptracer(proc.pid)
    try:
        # The tensor starts inside its segment (and inside a page), and spans
        # several pages of an expandable segment.
        pad = torch.empty(3 * MIB + 512, dtype=torch.uint8, device="cuda")
        n, m = (11 * MIB + 4096) // 4, (2 * MIB) // 4
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        x = expected(torch, n, 1)
        w = expected(torch, m, 3)  # a second tensor, after x in the same segment
        torch.cuda.synchronize()
        addr = x.data_ptr()
        shared = spy_on_sharing(torch)
        inbox.put((x, w, n, m))
        y_ptr, w_ptr = reply(outbox, "written")
        check(len(shared) == 2, "two storages shared: %d" % len(shared))
        (handle, offset), (w_handle, _) = shared
        kind = "raw 'c'" if len(handle) == 64 else "'%s'" % chr(handle[1])
        if handle == w_handle:
            # One handle, one mapping in the receiver (its cache): same distances.
            check(w_ptr - y_ptr == w.data_ptr() - addr,
                  "two tensors of one shared segment: %#x apart in the sender, %#x in the "
                  "receiver" % (w.data_ptr() - addr, w_ptr - y_ptr))
        del w
        torch.cuda.synchronize()
        check(torch.equal(x, expected(torch, n, 2)), "the sender sees the receiver's writes")
        # The sender lets go while the receiver holds its view: the block must stay
        # allocated (PyTorch's IPC reference counting keeps it in limbo).
        del x
        gc.collect()
        z = torch.full((n,), -7.0, device="cuda")
        torch.cuda.synchronize()
        check(z.data_ptr() != addr,
              "the block at %#x was handed out again while the receiver held it" % addr)
        inbox.put("check")
        intact = reply(outbox, "released")
        check(intact, "the receiver's view was overwritten while it held it")
        proc.join(TIMEOUT)
        check(proc.exitcode == 0, "receiver exit code %s" % proc.exitcode)
        del z
        gc.collect()
        torch.cuda.ipc_collect()  # the limbo's blocks are freed once the receiver let go
        torch.cuda.synchronize()
        check(torch.cuda.memory_allocated() == allocated,
              "after the receiver let go and ipc_collect, %d bytes allocated, %d before the "
              "shared tensors" % (torch.cuda.memory_allocated(), allocated))
        del pad
        same = "one mapping for both" if handle == w_handle else "two handles"
        return "%s -> %s: %s handle of %d bytes, offset %d, receiver's view at %#x; second " \
               "tensor: %s; writes seen; block kept while held, freed after%s" % (
                   send_side, recv_side, kind, len(handle), offset, y_ptr, same, note)
    finally:
        if proc.is_alive():
            proc.kill()


def spy_on_sharing(torch):
    """Records (handle bytes, offset) of every storage this process shares from now on
    (torch.multiprocessing's reduction calls UntypedStorage._share_cuda_, in the queue's
    feeder thread)."""
    shared = []
    original = torch.UntypedStorage._share_cuda_

    def share(self):
        result = original(self)
        shared.append((result[1], result[3]))
        return result

    torch.UntypedStorage._share_cuda_ = share
    return shared


def main(names):
    names = names or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print("unknown case(s) %s; cases: %s" % (" ".join(unknown), " ".join(CASES)))
        return 2
    # Build the bridge once, before the timed cases.
    subprocess.run([sys.executable, __file__, "--build"], timeout=1800, check=False)
    failed = 0
    for name in names:
        t = time.time()
        try:
            r = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--case", name],
                               capture_output=True, text=True, timeout=4 * TIMEOUT)
            out, err, code = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out, err, code = e.stdout or "", (e.stderr or "") + "\ntimed out", -1
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        lines = [l for l in out.splitlines() if l.startswith("CASE ")]
        ok = code == 0 and bool(lines)
        detail = lines[-1][5:] if lines else ((err.strip().splitlines() or
                                               ["no output (exit %s)" % code])[-1])
        print("%s  %-24s (%.1f s) %s" % ("PASS" if ok else "FAIL", name, time.time() - t, detail),
              flush=True)
        if not ok:
            failed += 1
            sys.stdout.write(out[-3000:] + err[-3000:] + "\n")
    if failed:
        print("%d of %d IPC cases FAILED" % (failed, len(names)))
        return 1
    print("RESULT %d IPC cases passed (gpualloc and PyTorch's allocator, both directions, "
          "'c' and 'e' handles)" % len(names))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--build":
        import gpu_alloc

        gpu_alloc.build_bridge()
    elif len(sys.argv) > 2 and sys.argv[1] == "--case":
        print("CASE " + run_case(sys.argv[2]), flush=True)
    else:
        sys.exit(main(sys.argv[1:]))
