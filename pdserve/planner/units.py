"""Units, element sizes, number formatting and catalog-name matching.

Decimal units (KB, MB, GB, TB = 10^3 .. 10^12 bytes) are used for weights,
bandwidths and network rates, as vendors quote them. Binary units (KiB, MiB,
GiB = 2^10 .. 2^30 bytes) are used for KV sizes and GPU memory: the usual
"320 KB per token" is 80 x 4,096 bytes = 320 KiB, and an "80 GB" HBM stack is
80 GiB of DRAM. Every figure the planner prints names which one it is.
"""

from __future__ import annotations

import math

from pdserve.config import canonical_dtype

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
KiB, MiB, GiB = 2**10, 2**20, 2**30

# Bytes per stored element: FP16 2, FP8 1, INT4 0.5 (names as config.py spells them).
BYTES_PER_ELEMENT = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}


def element_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype``; ValueError naming the known ones."""
    try:
        return BYTES_PER_ELEMENT[canonical_dtype(dtype)]
    except KeyError:
        known = ", ".join(BYTES_PER_ELEMENT)
        raise ValueError(f"unknown dtype {dtype!r}; known: {known}") from None


def ceil_count(x: float) -> int:
    """Round a count up, ignoring float noise (3 x 1.3 is 3.9000000000000004,
    10 x 1.3 is 13.000000000000002: the latter must stay 13, not become 14)."""
    return math.ceil(round(x, 9))


def fmt_bytes(n: float) -> str:
    """Bytes shown in both decimal and binary units, e.g. '21.47 GB = 20.00 GiB'."""
    for dec, dec_name, binary, bin_name in (
        (GB, "GB", GiB, "GiB"),
        (MB, "MB", MiB, "MiB"),
        (KB, "KB", KiB, "KiB"),
    ):
        if abs(n) >= binary:
            return f"{n / dec:,.2f} {dec_name} = {n / binary:,.2f} {bin_name}"
    return f"{n:,.0f} B"


def fmt_gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def fmt_gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def fmt_s(t: float) -> str:
    """A duration in the unit that keeps three significant figures readable."""
    if t == math.inf:
        return "inf"
    if abs(t) >= 1.0:
        return f"{t:,.3f} s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:,.2f} ms"
    return f"{t * 1e6:,.2f} us"


def fmt_si(x: float, unit: str) -> str:
    """A rate with an SI prefix: fmt_si(989e12, 'FLOP/s') -> '989 TFLOP/s'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:,.4g} {prefix}{unit}"
    return f"{x:,.4g} {unit}"


def fmt_count(x: float) -> str:
    """A large count in engineering notation, e.g. 70.55e9."""
    for factor, suffix in ((1e12, "e12"), (1e9, "e9"), (1e6, "e6"), (1e3, "e3")):
        if abs(x) >= factor:
            return f"{x / factor:.4g}{suffix}"
    return f"{x:.4g}"


def catalog_lookup(name: str, table: dict, aliases: dict[str, str]):
    """The row of ``table`` named ``name`` or one of its aliases, ignoring
    case, dashes, underscores and spaces ("Llama_3 70B", "H100"); else None."""

    def key(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum() or c == ".")

    wanted = key(name)
    for known in table:
        if key(known) == wanted:
            return table[known]
    for alias, known in aliases.items():
        if key(alias) == wanted:
            return table[known]
    return None
