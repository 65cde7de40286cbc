"""The KV connector contract: how a prefill worker's KV cache reaches a decode worker.

In the spirit of vLLM's KV connector: the prefill side *saves* layers as its
forward pass produces them (`save_layer`, then `wait_for_save`); the decode side
*expects* a transfer into blocks it reserved (`expect`) and waits for all of
it (`wait_for_all`).

Data moves as tokens, not blocks: the sender ships, per layer, K and V of a
token range as `[n_tokens, n_kv_heads, head_dim]`; the receiver scatters them
into its own slots. So the two sides may use different block sizes and KV
dtypes, and a decode worker that already caches a prefix (`start_token`) is
sent only the rest (incremental transfer).

Backends (beside this file): `tcp` (length-prefixed frames: a JSON header and
raw tensor bytes, received straight into a staging buffer; never pickle),
`shm` (one host: the decode worker's cache lives in shared memory and the
prefill worker writes into the reserved slots directly; only a notice travels).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


class KVTransferError(RuntimeError):
    """A transfer failed: peer gone, connection cut, deadline passed, bad frame."""


# A decode worker keeps blocks it gave up (an abort, an expired lease, a recompute) out of use
# this long past the lease of a sender that may write into them itself (shared memory, NIXL):
# that sender stops at its lease's end, counted from later than the reservation by the
# destination's trip through the router.
IN_PLACE_FENCE_MARGIN_S = 5.0


@dataclass
class KVDestination:
    """What a decode worker answers when it reserves room for a request's KV."""

    transfer_id: str
    address: str  # "tcp://host:port" or "shm://host:port" (the notice channel)
    block_ids: list[int]  # the decode worker's blocks, covering tokens from 0
    block_size: int
    start_token: int = 0  # tokens the decode worker already caches: not sent
    num_tokens: int = 0  # prompt tokens the KV must cover in the end
    pull: bool = False  # the decode worker will fetch the KV instead of receiving a push
    # shm only: the decode worker's cache files and layout
    shm_paths: list[str] = field(default_factory=list)
    shm_shape: list[int] = field(default_factory=list)
    shm_dtype: str = ""
    # when the receiver may free the blocks (its lease, wall clock; 0: not said): a sender that
    # writes into them itself (shared memory, NIXL) stops short of it, and the transfer fails
    expires_unix: float = 0.0
    # the same lease in seconds from the reservation (0: not said): the sender counts it from
    # when the destination reached it too (`localize_lease`), so a clock behind the receiver's
    # cannot stretch it
    lease_s: float = 0.0

    def localize_lease(self, now_unix: float) -> None:
        """On the sender, as the destination arrives: `expires_unix` no later than `lease_s` from
        now by this host's clock. The receiver fences blocks it gave up till its own lease's end
        plus IN_PLACE_FENCE_MARGIN_S, so a sender that writes in place never outlives them by
        clock skew, only by the destination's trip here (well under the margin)."""
        if self.lease_s > 0:
            local = now_unix + self.lease_s
            self.expires_unix = min(self.expires_unix, local) if self.expires_unix else local

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict) -> KVDestination:
        return cls(**d)


@dataclass
class TransferStats:
    bytes: int = 0
    layers: int = 0
    started_s: float = 0.0
    finished_s: float = 0.0
    retries: int = 0


class KVSender(abc.ABC):
    """Prefill side."""

    @abc.abstractmethod
    def begin(self, dest: KVDestination, num_layers: int) -> None:
        """Open a transfer; layers follow with `save_layer`."""

    @abc.abstractmethod
    def save_layer(self, transfer_id: str, layer: int, token_start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue K and V of tokens [token_start, token_start + n) of one layer; returns at once.

        The tensors must not be written afterwards (pass copies of the cache)."""

    @abc.abstractmethod
    def finish(self, transfer_id: str) -> None:
        """No more layers will come; the receiver acknowledges once it holds everything."""

    @abc.abstractmethod
    def wait_for_save(self, transfer_id: str, timeout_s: float) -> TransferStats:
        """Block until the receiver acknowledged the whole transfer; raise KVTransferError."""

    @abc.abstractmethod
    def abort(self, transfer_id: str, reason: str) -> None:
        """Give up a transfer (its request was aborted): frames not sent yet are dropped and
        the receiver is told, so it frees the blocks it reserved now, not at its deadline."""

    def fail(self, transfer_id: str, reason: str) -> None:
        """A layer of this transfer could not be saved (a destination that does not fit): the
        transfer fails (`wait_for_save` raises `reason`, the decode worker recomputes), and
        only it: the step that produced it, and every other request in it, go on."""
        self.abort(transfer_id, reason)

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Decode side."""

    address: str

    @abc.abstractmethod
    def expect(self, dest: KVDestination, slots: torch.Tensor, num_layers: int, deadline_s: float) -> None:
        """Accept a transfer into `slots` (this side's flat slot of each token from
        dest.start_token to dest.num_tokens)."""

    @abc.abstractmethod
    def wait_for_all(self, transfer_id: str, timeout_s: float) -> TransferStats: ...

    @abc.abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Forget a transfer (lease expired, request aborted); late frames are dropped."""

    @abc.abstractmethod
    def close(self) -> None: ...
