"""Fault injection, for the failure-path tests and the chaos benchmark: one hook.

The production code marks the few places where a fault can strike (`FaultSet.before_kv_frame`
in the KV sender, `FaultSet.before_prefill` in the worker's prefill route, `FaultSet.before_step`
on the engine thread); what each fault does
lives here. A fault strikes only once armed, and arming takes one of

- `$PDSERVE_KV_FAULT` in the process's environment, read when the sender and the worker API
  start (the tests that run real worker processes);
- the worker's `POST /internal/fault`, which answers 404 unless the process was started with
  `PDSERVE_ENABLE_FAULT_INJECTION=1` (the chaos benchmark), and needs the cluster token.

A spec is a comma-separated list of `name=LAYER[:ARG]`; each fault fires once:

    cut_at_layer=K        the KV sender shuts its connection down before layer K's frame
    stall_at_layer=K:S    ... sleeps S seconds before it
    corrupt_at_layer=K    ... sends a frame header of garbage (not JSON, not UTF-8) before it:
                          the receiver drops that connection, the sender resends on a new one
    exit_at_layer=K       ... the process dies there (exit code 17)
    delay_prefill=0:S     the worker's next prefill starts S seconds late
    fail_step=0           the engine's next step raises (the process then fails its requests
                          with 503 and exits 1, as after any failed step)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

log = logging.getLogger("pdserve.faults")

SPEC_ENV = "PDSERVE_KV_FAULT"
ENABLE_ENV = "PDSERVE_ENABLE_FAULT_INJECTION"  # the /internal/fault route answers only with this set to 1
KV_FAULTS = ("cut_at_layer", "stall_at_layer", "exit_at_layer", "corrupt_at_layer")
WORKER_FAULTS = ("delay_prefill",)
ENGINE_FAULTS = ("fail_step",)
EXIT_CODE = 17
_GARBAGE = b"{corrupt: \xff\xfe injected by PDSERVE_KV_FAULT}"
_GARBAGE_FRAME = struct.pack("!I", len(_GARBAGE)) + _GARBAGE  # length-prefixed, as a frame header is


def route_enabled() -> bool:
    return os.environ.get(ENABLE_ENV) == "1"


def parse(
    spec: str | None, allowed: tuple[str, ...] = KV_FAULTS + WORKER_FAULTS + ENGINE_FAULTS
) -> dict[str, tuple[int, float]]:
    """{name: (layer, arg)} of a spec; ValueError for a name not in `allowed` or a bad number."""
    out = {}
    for item in filter(None, (spec or "").split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in allowed:
            raise ValueError(f"unknown fault {name!r}; one of {', '.join(allowed)}")
        layer, _, arg = value.partition(":")
        out[name] = (int(layer), float(arg or 0))
    return out


class FaultSet(dict):
    """The faults armed in one component, {name: (layer, arg)}: empty (and false) unless a
    test armed one, so the hooks cost one truth test on the hot path."""

    def __init__(self, allowed: tuple[str, ...], spec: str | None = None):
        super().__init__({k: v for k, v in parse(spec).items() if k in allowed})
        self.allowed = allowed

    @classmethod
    def from_env(cls, allowed: tuple[str, ...]) -> FaultSet:
        """The faults of $PDSERVE_KV_FAULT that are this component's (the others are another's)."""
        return cls(allowed, os.environ.get(SPEC_ENV))

    def arm(self, spec: str) -> None:
        """Add the faults of `spec`; ValueError if one is not this component's."""
        faults = parse(spec)
        other = set(faults) - set(self.allowed)
        if other:
            raise ValueError(f"not a fault of this component ({', '.join(self.allowed)}): {', '.join(sorted(other))}")
        self.update(faults)

    def _take(self, name: str, layer: int) -> tuple[int, float] | None:
        """The fault `name` if it is armed for `layer`; it fires once, so it is disarmed."""
        fault = self.get(name)
        if fault is None or fault[0] != layer:
            return None
        return self.pop(name, fault)

    # ---- the hooks
    def before_kv_frame(self, layer: int, sock: socket.socket) -> None:
        """The KV sender is about to write a frame of `layer` on `sock`."""
        stall = self._take("stall_at_layer", layer)
        if stall:
            time.sleep(stall[1])
        if self._take("cut_at_layer", layer):
            sock.shutdown(socket.SHUT_RDWR)
        if self._take("corrupt_at_layer", layer):
            log.warning("fault: a corrupt frame header before layer %s", layer)
            sock.sendall(_GARBAGE_FRAME)
        if self._take("exit_at_layer", layer):
            os._exit(EXIT_CODE)

    async def before_prefill(self) -> None:
        """The worker is about to start a prefill."""
        delay = self._take("delay_prefill", 0)
        if delay:
            await asyncio.sleep(delay[1])

    def before_step(self) -> None:
        """The engine thread is about to run a step."""
        if self._take("fail_step", 0):
            raise RuntimeError("fault: injected engine step failure")
