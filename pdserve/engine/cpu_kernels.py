"""C++ kernels for the CPU path, compiled on first use and cached.

Compiled with torch's extension builder (gcc + ninja) into
$PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/kernels). If compiling is not
possible the engine falls back to pure PyTorch, slower but identical in
meaning; `PDSERVE_NO_KERNELS=1` forces that fallback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("pdserve.kernels")
_lock = threading.Lock()
_module = None
_failed = False


_SOURCES = (
    "paged_attention.cpp",
    "gguf_matmul.cpp",
    "decode_layer.cpp",
    "pool_check.cpp",
    "prefill_attention.cpp",
    "elementwise.cpp",
    "int8_gemm.cpp",
)
_HEADERS = ("pool.h", "simd_exp.h")  # part of the cache key, not compiled on their own
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _default_cache_dir(srcs: list[str]) -> str:
    """One build per interpreter prefix, torch version, source directory and source text:
    two checkouts or virtual environments sharing one directory would otherwise rebuild
    over each other's module (the build script names its sources by absolute path, so
    two checkouts of the same text rebuilt everything each time the other had built), and
    CPU feature set: the build is -march=native, so a home directory shared by hosts of
    different CPUs (AMX on one, AVX2 only on another) must not hand one host's module to
    the other, which would die on the first instruction it lacks."""
    import hashlib
    import sys

    import torch

    from pdserve.config import cpu_flags

    key = f"{sys.prefix}|{torch.__version__}|{_CFLAGS}|{os.path.dirname(srcs[0])}|{' '.join(sorted(cpu_flags()))}"
    h = hashlib.sha1(key.encode())
    for path in srcs + [os.path.join(os.path.dirname(srcs[0]), hd) for hd in _HEADERS]:
        with open(path, "rb") as f:
            h.update(f.read())
    return os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "kernels", h.hexdigest()[:12])


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("PDSERVE_NO_KERNELS"):
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load as build

                csrc = os.path.join(os.path.dirname(__file__), "csrc")
                srcs = [os.path.join(csrc, f) for f in _SOURCES]
                cache = os.environ.get("PDSERVE_KERNEL_CACHE") or _default_cache_dir(srcs)
                os.makedirs(cache, exist_ok=True)
                fresh = not any(f.endswith(".so") for f in os.listdir(cache))
                if fresh:  # say why the first start is silent for a minute or two
                    log.info(
                        "building the C++ CPU kernels into %s (once per checkout and torch version; "
                        "1-2 minutes on 2 cores; `make setup` does it ahead)",
                        cache,
                    )
                t0 = time.monotonic()
                with _build_lock(cache):
                    _module = build(
                        "pdserve_cpu_kernels",
                        srcs,
                        build_directory=cache,
                        extra_cflags=_CFLAGS,
                        extra_ldflags=["-fopenmp"],
                        verbose=False,
                    )
                if fresh:
                    log.info("CPU kernels built in %.0f s", time.monotonic() - t0)
            except Exception as e:  # no compiler, no headers, no ninja: run without
                log.warning("CPU kernels unavailable, using the PyTorch fallback: %s", e)
                _failed = True
    return _module


@contextlib.contextmanager
def _build_lock(cache: str):
    """One build at a time per cache directory, across processes, that a dead builder
    cannot hold.

    torch's builder guards the directory with a `lock` file it makes and removes
    itself: a process killed mid-build (a worker stopped by a test, an OOM kill)
    leaves it behind, and every later start then waits for it forever. An fcntl
    lock dies with its process; whoever holds it is the only builder, so a torch
    `lock` file found then is stale and is removed."""
    import fcntl

    with open(os.path.join(cache, "pdserve-build.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = os.path.join(cache, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
