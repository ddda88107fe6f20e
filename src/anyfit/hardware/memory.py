"""Device memory, read one way everywhere: peak, free, total, the run's budget, out-of-memory errors.

The micro-batch probe, the metrics line, generation's batch size and the planner's "this machine" all
ask this module, so a number printed in one place means the same thing in the others:

- CUDA: the caching allocator's counters (``max_memory_allocated``, ``mem_get_info``);
- MPS: Metal's driver-allocated bytes and its recommended working set (unified memory);
- CPU: the process's peak resident set (a high-water mark) and the host RAM still available.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys

import torch

GIB = 2**30


def is_oom(error: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the MPS and CPU allocators raise RuntimeError with a message."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "failed to allocate" in text
                                                or "can't allocate memory" in text)


def release_cached(device: str) -> None:
    """Return cached blocks to the device after an out-of-memory error, a probe or a sharded model's set-up
    (objects must be dropped first). On the CPU the cache is the C library's: glibc keeps freed heap memory
    resident for reuse (a sharded set-up frees a whole model's worth of broadcast buffers), and
    ``malloc_trim`` gives it back to the OS. Hand-written through ctypes: PyTorch's CPU allocator is plain
    malloc and no library exposes the call."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "mps":
        torch.mps.empty_cache()
    elif sys.platform.startswith("linux"):
        try:
            trim = getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
        except OSError:  # another C library (musl): nothing to call
            trim = None
        if trim is not None:
            trim(0)


def reset_peak(device: str) -> None:
    """Start a new peak measurement (CUDA only: the CPU high-water mark cannot be reset, so probes go small to large)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int:
    """Peak memory of this process: CUDA max allocated, MPS driver-allocated, CPU max resident set."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    if device == "mps":
        return torch.mps.driver_allocated_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def total_bytes(device: str) -> int:
    """What the device offers: CUDA total, MPS recommended working set, CPU RAM available now plus this
    process's own resident set (other processes count; what this one holds is its own to reuse)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    if device == "mps":
        return int(torch.mps.recommended_max_memory())
    import psutil  # a dependency of accelerate

    return int(psutil.virtual_memory().available + psutil.Process().memory_info().rss)


def free_bytes(device: str) -> int:
    """Memory still free on ``device`` (what is already allocated there is taken)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    if device == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    import psutil

    return int(psutil.virtual_memory().available)


def budget_bytes(device: str, fraction: float) -> int:
    """How much a run may use: ``runtime.memory_fraction`` of what the device offers."""
    return int(total_bytes(device) * fraction)
