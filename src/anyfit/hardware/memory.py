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



def is_oom(error: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the MPS and CPU allocators raise RuntimeError with a message."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "failed to allocate" in text
                                                or "can't allocate memory" in text)


# glibc's mallopt parameter for the size above which an allocation gets its own mapping (malloc.h), and the
# value anyfit pins it to: glibc's own starting threshold, 128 KiB.
_M_MMAP_THRESHOLD = -3
HOST_MMAP_THRESHOLD = 128 * 1024


def _glibc():
    """The C library's functions where they are glibc's (Linux); None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl): nothing to call
        return None


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
    elif (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def keep_host_heap_small() -> bool:
    """Give freed tensors' host memory back to the OS as they are freed, for the rest of the process.

    glibc serves an allocation above its mmap threshold (128 KiB at start) with its own mapping, returned on free,
    but raises the threshold to the size of each such block freed (up to 32 MiB): after a few steps every tensor
    below 32 MiB lives on the heap, and the heap keeps what was freed (BENCHMARKS.md, 'Host RAM of sharded training:
    the model read once (issue 20, CPU)'). Pinned here as the environment variable ``MALLOC_MMAP_THRESHOLD_`` would,
    which also stops the raising. Returns whether it was set (glibc only). Hand-written through ctypes: no library
    exposes ``mallopt``; jemalloc or tcmalloc would need preloading."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))


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
