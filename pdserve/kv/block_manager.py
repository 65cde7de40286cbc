"""Paged KV block accounting: the block pool, block tables, prefix cache, ref counts.

This file holds no tensors: it decides which block ids a sequence owns. The
model runner turns block tables into slot mappings (`pdserve.kv.slots`); the
simulator reuses this same class with a latency model in place of the model.

Life of a block: free (maybe still holding a cached prefix, findable by hash)
-> owned by one or more sequences (ref_cnt > 0) -> back to the free queue when
the last owner lets go. The free queue is LRU: allocation takes from its head,
so the least recently used cached prefix is the one evicted.

Only full, registered blocks are ever shared (a prefix-cache hit, which always
leaves the sequence's last token to compute), and a registered block keeps its
hash while anyone owns it, so no sequence writes into a block another one
holds: there is no copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.kv.hashing import block_hashes, extend_block_hashes


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered
    token_ids: tuple | None = None  # its tokens, kept while registered when lower tiers are on


@dataclass
class KVEvent:
    """A change in what this worker caches; the router's prefix index follows these."""

    kind: str  # "stored" | "evicted" | "cleared"
    block_hashes: list[int]


@dataclass
class PrefixCacheStats:
    queries_tokens: int = 0
    hits_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0


@dataclass
class SeqBlocks:
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of this sequence's full blocks
    num_cached_blocks: int = 0  # how many of `blocks` are registered in the prefix cache


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, record_events: bool = False
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, Block] = {}  # block hash -> block holding that prefix
        self.seqs: dict[str, SeqBlocks] = {}
        self.fenced: list[tuple[float, str, SeqBlocks]] = []  # (free at, seq id, blocks) held back by `fence`
        self.stats = PrefixCacheStats()
        self.record_events = record_events
        self.events: list[KVEvent] = []
        # With lower KV tiers: registered blocks evicted, and blocks registered, since the last
        # drain, as (block id, hash, token ids); the KV store copies their data out before reuse.
        self.track_tiers = False
        self.evicted: list[tuple[int, int, tuple]] = []
        self.registered: list[tuple[int, int, tuple]] = []

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def owns_blocks(self, seq_id: str) -> bool:
        sb = self.seqs.get(seq_id)
        return sb is not None and bool(sb.blocks)

    def block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.seqs[seq_id].blocks]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache
    def find_cached_prefix(self, seq_id: str, token_ids: list[int], root: int) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of `token_ids`.

        At least one token is always left to compute: the step that computes it
        produces the logits for the next token. `root`: where the sequence's hash chain
        starts (`hashing.salt_root` of its cache salt; `Sequence.hash_root`), in this and the
        other hashing calls; no default, so that no caller can lose a request's salt.
        """
        if not self.enable_prefix_caching:
            return [], 0
        sb = self.seqs.setdefault(seq_id, SeqBlocks())
        sb.hashes = block_hashes(token_ids, self.block_size, start=sb.hashes, root=root)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit: list[Block] = []
        for h in sb.hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        self.stats.queries_tokens += len(token_ids)
        self.stats.hits_tokens += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def first_uncached_hash(self, seq_id: str, token_ids: list[int], root: int) -> int | None:
        """Hash of the first full block of `token_ids` that the prefix cache lacks (the last
        token aside, as in `find_cached_prefix`); None when all are cached or prefix caching is
        off. Unlike `find_cached_prefix` it counts no query (the scheduler asks it of a request
        it may put off)."""
        if not self.enable_prefix_caching:
            return None
        sb = self.seqs.setdefault(seq_id, SeqBlocks())
        sb.hashes = block_hashes(token_ids, self.block_size, start=sb.hashes, root=root)
        for h in sb.hashes[: (len(token_ids) - 1) // self.block_size]:
            if h not in self.cached:
                return h
        return None

    def pending_hashes(self, seq_id: str) -> list[int]:
        """Hashes of a sequence's full prompt blocks not registered yet: those it is computing."""
        sb = self.seqs.get(seq_id)
        return sb.hashes[sb.num_cached_blocks :] if sb is not None else []

    # ---- allocation
    def allocate(self, seq_id: str, num_total_tokens: int, cached: list[Block] | None = None) -> bool:
        """Make the sequence own enough blocks for `num_total_tokens`; False if the pool is short.

        `cached` are prefix blocks from `find_cached_prefix`, taken (ref_cnt+1)
        only when the whole allocation succeeds.
        """
        sb = self.seqs.setdefault(seq_id, SeqBlocks())
        cached = cached or []
        if cached and sb.blocks:
            raise RuntimeError(f"{seq_id}: cached prefix offered to a sequence that owns blocks")
        have = len(sb.blocks) + len(cached)
        need_new = max(0, self.blocks_needed(num_total_tokens) - have)
        # Taking a cached block that sits in the free queue removes it from there.
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        if need_new + revived > self.num_free_blocks:
            return False
        for b in cached:
            self._touch(b)
        if cached:  # the sequence owned nothing (checked above): these are its registered prefix
            sb.blocks.extend(cached)
            sb.num_cached_blocks = len(cached)
        # blocks it owns already are registered by cache_full_blocks once full, not here: a
        # block half filled by the last chunk or decode step is not in the prefix cache yet
        sb.blocks.extend(self._pop_free() for _ in range(need_new))
        return True

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed_tokens: int, root: int) -> None:
        """Register blocks made full by the last step so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        sb = self.seqs[seq_id]
        num_full = min(num_computed_tokens // self.block_size, len(sb.blocks))
        if num_full <= sb.num_cached_blocks:
            return
        if len(sb.hashes) < num_full:
            extend_block_hashes(sb.hashes, token_ids, num_full, self.block_size, root=root)
        first = sb.num_cached_blocks
        stored = []
        for i in range(first, num_full):
            block, h = sb.blocks[i], sb.hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block
                stored.append(h)
                if self.track_tiers:
                    block.token_ids = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                    self.registered.append((block.block_id, h, block.token_ids))
        sb.num_cached_blocks = num_full
        if stored and self.record_events:
            self.events.append(KVEvent("stored", stored))

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks. Tail blocks go to the LRU head first, so a
        shared prefix outlives the unique suffixes built on it."""
        sb = self.seqs.pop(seq_id, None)
        if sb is not None:
            self._release(sb)

    def fence(self, seq_id: str, until: float) -> int:
        """Take a sequence's blocks away from it without freeing them until the monotonic
        time `until` (`release_fenced`): another process may still write into them (a prefill
        worker that writes KV into this cache itself, until its lease runs out), so no other
        request may have them before then. Returns how many blocks it fenced."""
        sb = self.seqs.pop(seq_id, None)
        if sb is None or not sb.blocks:
            return 0
        self.fenced.append((until, seq_id, sb))
        return len(sb.blocks)

    def release_fenced(self, now: float, seq_ids: set[str] | frozenset = frozenset()) -> int:
        """Free the fenced blocks whose time has come, and those of `seq_ids` (their writer is
        known to be done); returns how many were freed."""
        due = [f for f in self.fenced if f[0] <= now or f[1] in seq_ids]
        if not due:
            return 0
        self.fenced = [f for f in self.fenced if not (f[0] <= now or f[1] in seq_ids)]
        for _, _, sb in due:
            self._release(sb)
        return sum(len(sb.blocks) for _, _, sb in due)

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(sb.blocks) for _, _, sb in self.fenced)

    def _release(self, sb: SeqBlocks) -> None:
        for b in reversed(sb.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = None
                if b.block_hash is None:
                    self.free_queue.move_to_end(b.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if b.ref_cnt == 0:
                b.block_hash = None
                b.token_ids = None
                del self.cached[h]
        if self.record_events:
            self.events.append(KVEvent("cleared", []))

    def drain_tier_moves(self) -> tuple[list, list]:
        """(evicted, registered) since the last call; see `track_tiers`."""
        ev, reg = self.evicted, self.registered
        self.evicted, self.registered = [], []
        return ev, reg

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    # ---- internals
    def _touch(self, b: Block) -> None:
        if b.ref_cnt == 0:
            del self.free_queue[b.block_id]
        b.ref_cnt += 1

    def _pop_free(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        b = self.blocks[block_id]
        if b.block_hash is not None:  # evict the cached prefix it held
            del self.cached[b.block_hash]
            if self.record_events:
                self.events.append(KVEvent("evicted", [b.block_hash]))
            if self.track_tiers and b.token_ids is not None:
                self.evicted.append((b.block_id, b.block_hash, b.token_ids))
            b.block_hash = None
            b.token_ids = None
        b.ref_cnt = 1
        return b
