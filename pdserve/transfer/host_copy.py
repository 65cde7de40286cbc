"""Moving KV between a cache in GPU memory and the host memory a socket reads and writes.

A socket can only send host bytes, so a layer gathered out of a CUDA cache goes through host
memory on the way out, and a received layer comes back through it on the way in. Pinned
(page-locked) host memory lets the copy engine move the bytes by DMA, where pageable memory
makes the driver bounce them through a pinned buffer of its own. Pinned tensors come from
torch's caching host allocator, which reuses them once the copies that used them are done,
so a steady stream of layers does not pin new memory each time.

On a CPU cache every function here hands back its argument unchanged: the CPU path moves
the same bytes as before, with no copy added.
"""

from __future__ import annotations

import torch


def to_host(x: torch.Tensor) -> torch.Tensor:
    """`x` in host memory, ready to be read by a socket write.

    CUDA: one non-blocking copy into pinned memory, then a wait on the copying stream, so
    the bytes are all there before anyone reads them (the socket write comes right after).
    CPU: `x` itself."""
    if not x.is_cuda:
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` (received into host memory) on `device`, the cache's.

    The copy is synchronous: the host buffer it reads from is reused for the next frame as
    soon as this returns. CPU: `x` itself."""
    if device.type == "cpu":
        return x
    return x.to(device)


def receives_in_place(cache: torch.Tensor) -> bool:
    """Whether a socket can receive straight into `cache`'s memory (host memory only)."""
    return not cache.is_cuda
