"""Vectorised dequantization of the common GGUF block formats with torch.

`gguf.quants.dequantize` (numpy) takes ~8 s for SmolLM2's 135M weights here;
these few formats cover the embedded model and most community GGUFs, and
anything else falls back to the `gguf` package.
"""

from __future__ import annotations

import numpy as np
import torch

# type name -> (bytes per block of 32 weights)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize(data: np.ndarray, type_name: str, n_elements: int) -> torch.Tensor | None:
    """`data` is the raw bytes (uint8); returns a flat fp32 tensor, or None for a type not handled here."""
    if type_name == "F32":
        return torch.from_numpy(np.array(data).view(np.float32).reshape(-1))
    if type_name == "F16":
        return torch.from_numpy(np.array(data).view(np.float16).reshape(-1)).float()
    if type_name == "BF16":
        raw = torch.from_numpy(np.array(data).view(np.int16).reshape(-1))
        return raw.view(torch.bfloat16).float()
    size = _BLOCK_BYTES.get(type_name)
    if size is None:
        return None
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, size))
    if blocks.shape[0] * 32 != n_elements:
        raise ValueError(f"{type_name}: {blocks.shape[0]} blocks for {n_elements} weights")
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if type_name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(-1)
    qs = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]
    # low nibbles are weights 0..15 of the block, high nibbles 16..31
    q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()
    if type_name == "Q4_0":
        return ((q - 8.0) * d).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(-1)
