"""The engine one worker runs: add requests, step, read outputs.

A step reads aloud: schedule tokens, run the model, sample, post-process.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from pdserve.config import EngineConfig
from pdserve.engine.loader import load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import Sampler, bad_words_token_ids
from pdserve.engine.sampling_params import InvalidRequest, SamplingParams
from pdserve.engine.scheduler import SampledToken, Scheduler
from pdserve.engine.sequence import PENDING, CompletionOutput, FinishReason, RequestOutput, Sequence, as_logprobs
from pdserve.engine.spec_decode import NgramProposer, SpecStats, verify
from pdserve.engine.step_trace import StepRecord, step_rows
from pdserve.engine.structured_outputs import StructuredOutputs
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.kv.block_manager import BlockManager
from pdserve.kv.slots import slot_mapping
from pdserve.kvstore.setup import build_kv_store
from pdserve.kvstore.store import BlockRef
from pdserve.transfer.bridge import PrefillBridge
from pdserve.transfer.connector import IN_PLACE_FENCE_MARGIN_S, KVDestination

log = logging.getLogger("pdserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_secret: bytes | None = None, kv_sender=None, kv_layerwise: bool = True):
        """`kv_secret`: the cluster secret that signs KV blocks in a shared store (the default
        is the one `pdserve.auth` finds). `kv_sender` (prefill role): the KVSender that ships
        the KV of requests that carry a destination, layer by layer or (not `kv_layerwise`)
        once the prompt is done."""
        t0 = time.monotonic()
        self.config = config
        if config.device.threads:
            torch.set_num_threads(config.device.threads)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model)
        self.model_config = loaded.config
        self.tokenizer = (
            Tokenizer.from_loaded(loaded)
            if config.tokenizer is None
            else Tokenizer.from_hf_dir(config.tokenizer, loaded.config.bos_token_id, loaded.config.eos_token_id)
        )
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings
        )
        self.runner = ModelRunner(loaded.config, config, loaded.state_dict, loaded.quantized)
        del loaded
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_id)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        self.kv_store = None
        if config.tiers.enabled:
            self.kv_store = build_kv_store(config, self.model_config, self.runner, kv_secret)
            self.block_manager.track_tiers = True
            self.scheduler.external = self.kv_store
        self.structured = StructuredOutputs(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        self.sampler = Sampler(self.runner.device, self.structured, self.bad_words_ids)
        self.drafter = None  # speculative decoding (spec_decode.py)
        self.spec_stats = SpecStats()
        if config.speculative is not None:
            self.drafter = self.scheduler.drafter = NgramProposer(config.speculative)
        self.lora = None  # lora.LoRAManager: the adapters requests may run with
        if config.lora.enable_lora:
            self._load_loras()
        self._bad_words: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()  # LRU: words -> ids
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Prefill role: ships KV of requests that carry a destination (see transfer/bridge.py)
        self.bridge = None
        if kv_sender is not None:
            self.bridge = PrefillBridge(kv_sender, self.model_config.num_hidden_layers, kv_layerwise)
        # Decode role: reserved requests not yet activated -> lease deadline
        self._reserved: dict[str, float] = {}
        # the receiver each reservation's KV arrives through: told to stop writing into the
        # blocks before they are freed (a frame still on its way must not land in another
        # request's blocks)
        self._receivers: dict[str, object] = {}
        # reservations a prefill worker may write into itself (shared memory, NIXL), until when
        # (monotonic): blocks given up before their KV is all in are fenced till then
        self._in_place: dict[str, float] = {}
        self._in_place_receivers: set = set()  # whose `senders_finished` end fences early
        self._senders_done: OrderedDict[str, None] = OrderedDict()  # ... the ids they named, latest last
        # ... and reservations waiting for room: id -> (arguments, wait deadline, on_done)
        self._pending_reserve: dict[str, tuple] = {}
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (not cached, not loaded)
        # finished outputs' logprobs as {token id: Logprob} (the offline API, as vLLM's) rather
        # than {token id: float} (what the servers format and send between workers)
        self.logprob_objects = False
        self._token_texts: dict[int, str] = {}
        self.last_schedule = None  # what the latest step ran (its sequences are already advanced)
        self._step_observers: list[Callable[[StepRecord], None]] = []
        self._idle = True  # found with nothing to do since the last step (StepRecord.idle)
        self.calibrating = False  # calibration requests are running (StepRecord.calibration)
        self.load_time_s = time.monotonic() - t0
        log.info(
            "engine ready in %.2fs: %s, %d KV blocks of %d tokens, %s on %s (%s)%s",
            self.load_time_s,
            self.model_config.name,
            self.runner.num_blocks,
            config.cache.block_size,
            config.device.dtype,
            config.device.device,
            config.device.dtype_reason,
            f"; GGUF block kernels for products of up to {self.runner.model.gguf_max_rows} rows"
            if self.runner.num_quantized_linears
            else "",
        )

    def _load_loras(self) -> None:
        from pdserve.engine.lora import LoRAManager, parse_modules

        self.lora = LoRAManager(self.model_config, self.config.lora, self.runner.dtype, self.runner.device)
        for name, path in parse_modules(self.config.lora.lora_modules):
            a = self.lora.load(name, path, pin=True)
            log.info(
                "LoRA adapter %s loaded from %s: rank %d, %d MiB (key %s)", name, path, a.rank, a.nbytes >> 20, a.key
            )
        self.runner.lora = self.lora
        self.scheduler.max_loras = self.config.lora.max_loras

    def add_lora(self, lora_request, keep=()) -> str:
        """Load a `lora.LoRARequest`'s adapter (once; the same files again are found loaded);
        returns its key, what a request's SamplingParams.lora_adapter names it by. `keep`: keys
        not to unload to make room (besides those requests use)."""
        if self.lora is None:
            raise InvalidRequest("this engine serves no LoRA adapters: start it with enable_lora", "lora_request")
        return self.install_lora(self.lora.read(lora_request.lora_name, lora_request.lora_path), keep)

    def install_lora(self, adapter, keep=()) -> str:
        """Serve an adapter read already (`LoRAManager.read`, off this thread); its key."""
        return self.lora.install(adapter, self._adapters_in_use() | set(keep)).key

    def remove_lora(self, name: str) -> bool:
        """New requests may no longer name the adapter `name` (vLLM's method); those running
        with it finish with it. False if none has that name."""
        return self.lora is not None and self.lora.remove(name, self._adapters_in_use())

    def _adapters_in_use(self) -> set[str]:
        """The adapters of every request here: sequences, and reservations waiting for room."""
        params = [s.params for s in self.seqs.values()] + [a[2] for a, _, _ in self._pending_reserve.values()]
        return {p.lora_adapter for p in params if p.lora_adapter is not None}

    def list_loras(self) -> dict[str, str]:
        """Adapter name -> key of the adapters loaded."""
        return self.lora.names() if self.lora is not None else {}

    # ---- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_destination=None,
        resume_token_ids: Seq[int] | None = None,
    ) -> Sequence:
        """Queue a request. `resume_token_ids`: output another worker already produced (it
        died mid-decode); they are recomputed here, not re-sent, and count towards max_tokens."""
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate(ids, params)
        resumed = [int(t) for t in resume_token_ids or ()]
        if resumed:
            vocab = self.model_config.vocab_size
            if min(resumed) < 0 or max(resumed) >= vocab:
                raise InvalidRequest(f"resumed token ids must be in [0, {vocab})", "resume_token_ids")
            if len(ids) + len(resumed) >= self.max_model_len:
                raise InvalidRequest(
                    f"the prompt and the resumed output hold {len(ids) + len(resumed)} tokens; this model's "
                    f"context is {self.max_model_len}",
                    "resume_token_ids",
                )
        if kv_destination is not None:
            if self.bridge is None:
                raise InvalidRequest("this worker cannot send KV (it has no KV bridge)", "kv_transfer")
            self._check_destination(kv_destination, len(ids))
        # checked: nothing below refuses, so nothing is left half-added
        seq = Sequence(
            request_id, ids, params, priority=priority, prompt=text, arrival_time=arrival_time or time.monotonic()
        )
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if resumed:
            seq.output_token_ids = resumed
            # the same detokenizer state the first worker had: held-back bytes complete later
            # token by token, as the first worker decoded them: a batch that ends inside a
            # UTF-8 character would hold back all of its text, and the whole of it would be
            # streamed again
            for t in seq.output_token_ids:
                seq.text.append(detok.step([t]))
            seq.emitted_text_len = len(seq.text)
        if kv_destination is not None:
            self.bridge.begin(request_id, kv_destination)  # KVTransferError: the caller's 503
        self.seqs[request_id] = seq
        self._detok[request_id] = detok
        self.scheduler.add(seq)
        return seq

    @staticmethod
    def _check_destination(dest, num_prompt_tokens: int) -> None:
        """What a prefill worker is told about where its KV goes, bounded before it computes:
        a destination that does not fit the prompt would fail in the middle of a step."""
        if not 0 <= dest.start_token <= dest.num_tokens <= num_prompt_tokens:
            raise InvalidRequest(
                f"the KV destination covers tokens [{dest.start_token}, {dest.num_tokens}) of a "
                f"{num_prompt_tokens}-token prompt",
                "kv_transfer",
            )
        if dest.block_size <= 0 or len(dest.block_ids) * dest.block_size < dest.num_tokens:
            raise InvalidRequest(
                f"{len(dest.block_ids)} blocks of {dest.block_size} tokens cannot hold {dest.num_tokens} tokens",
                "kv_transfer",
            )

    # ---- decode role: KV arrives from a prefill worker
    def reserve_for_transfer(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        receiver,
        deadline_s: float,
        arrival_time: float | None = None,
        wait_s: float = 0.0,
        on_done=None,
    ):
        """Reserve blocks for a prompt whose KV another worker computes.

        Full blocks this worker already caches are kept and not transferred
        (incremental transfer); returns the `KVDestination` the sender needs, or
        None when the scheduler has no room for it now. With `wait_s` and
        `on_done`, a reservation without room waits in line (first come, first
        served, behind the scheduler's own queue) for up to `wait_s`, and
        returns PENDING: `on_done(dest)` is called on the engine thread once
        room is found, or `on_done(None)` when the wait ends without it."""
        ids = [int(t) for t in prompt_ids]
        self._validate(ids, params)
        if request_id in self.seqs or request_id in self._pending_reserve:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        args = (request_id, ids, params, receiver, deadline_s, arrival_time or time.monotonic())
        dest = None if self._pending_reserve else self._try_reserve(*args)
        if dest is not None or wait_s <= 0 or on_done is None:
            return dest
        self._pending_reserve[request_id] = (args, time.monotonic() + wait_s, on_done)
        return PENDING

    @property
    def has_pending_reservations(self) -> bool:
        return bool(self._pending_reserve)

    def retry_reservations(self, now: float | None = None) -> None:
        """Admit waiting reservations in arrival order while there is room; end expired waits."""
        now = time.monotonic() if now is None else now
        for rid, (_, expires, on_done) in list(self._pending_reserve.items()):
            if now > expires:
                del self._pending_reserve[rid]
                on_done(None)
        while self._pending_reserve:
            rid, (args, _, on_done) = next(iter(self._pending_reserve.items()))
            dest = self._try_reserve(*args)
            if dest is None:
                return
            del self._pending_reserve[rid]
            on_done(dest)

    def cancel_reservation(self, request_id: str) -> None:
        """The caller gave up: drop a waiting reservation, or free one already made."""
        pending = self._pending_reserve.pop(request_id, None)
        if pending is not None:
            pending[2](None)
        else:
            self.abort_request(request_id)

    def _try_reserve(self, request_id, ids, params, receiver, deadline_s, arrival_time):
        bm = self.block_manager
        seq = Sequence(request_id, ids, params, arrival_time=arrival_time)
        if not self.scheduler.admit_remote(seq):
            return None  # no room now: the caller retries or picks another worker
        num_cached = seq.num_computed_tokens
        self._move_tiers()  # blocks it took may hold an evicted prefix: copy it out before the KV lands
        self.seqs[request_id] = seq
        self._reserved[request_id] = time.monotonic() + deadline_s
        self._receivers[request_id] = receiver
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        table = bm.block_table(request_id)
        dest = KVDestination(
            transfer_id=request_id,
            address=receiver.address,
            block_ids=table,
            block_size=bm.block_size,
            start_token=num_cached,
            num_tokens=len(ids),
            expires_unix=time.time() + deadline_s,
            lease_s=deadline_s,
        )
        if self.runner.kv_shm_paths:  # a sender on this host may write in place
            dest.shm_paths = self.runner.kv_shm_paths
            dest.shm_shape = self.runner.kv_shape
            dest.shm_dtype = self.config.device.dtype
        if dest.shm_paths or getattr(receiver, "scheme", "") == "nixl":
            self._in_place_receivers.add(receiver)
            self._senders_done.pop(request_id, None)  # an earlier transfer's word, not this one's
            # the sender stops writing at its lease's end (sender.check_lease), counted from when
            # it got the destination: later than now, by less than the margin
            self._in_place[request_id] = time.monotonic() + deadline_s + IN_PLACE_FENCE_MARGIN_S
        receiver.expect(
            dest,
            slot_mapping(table, num_cached, len(ids), bm.block_size),
            self.model_config.num_hidden_layers,
            deadline_s,
        )
        return dest

    def claim_reservation(self, request_id: str, hold_s: float) -> bool:
        """The decode for a reservation has begun: keep its blocks for hold_s more
        (the wait for the KV) instead of the lease counted from the reservation.
        False if the lease already expired and the blocks are gone."""
        if request_id not in self._reserved:
            return False
        self._reserved[request_id] = max(self._reserved[request_id], time.monotonic() + hold_s)
        return True

    def activate_transferred(self, request_id: str, first_token: int | None, kv_complete: bool):
        """Start decoding a reserved request.

        With the KV in place, the first token (sampled by the prefill worker) is
        appended and decoding continues; without it (the prefill worker died or
        the transfer failed) the missing prompt tokens are recomputed here."""
        seq = self.seqs[request_id]
        fence = self._stop_receiving(request_id)
        self._reserved.pop(request_id, None)
        self.scheduler.remote.pop(request_id, None)
        if fence and not kv_complete:
            # a sender that writes in place may still write into these blocks (it was slow, not
            # dead), and the request may be done and its blocks another's before it stops: they
            # stay fenced, and the prompt is recomputed into others (its cached prefix still hits)
            self.block_manager.fence(request_id, fence)
            seq.num_computed_tokens = 0
        if kv_complete:
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.block_manager.cache_full_blocks(request_id, seq.prompt_token_ids, seq.num_prompt_tokens, seq.hash_root)
        first = None
        if first_token is not None:
            token = int(first_token)
            if self.scheduler.append_token(seq, token, None, time.monotonic(), self._detokenize):
                self._forget(seq)
            first = self._output(seq, [token])
        if not seq.is_finished:
            self.scheduler.add(seq)
        return first

    def bad_words_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """The token sequences of a request's bad_words (sampler.bad_words_token_ids), cached; a
        word with no tokens, or a token the model cannot produce (a tokenizer's added token past
        the model's vocabulary), is refused here, when the request comes, never in a step."""
        found = self._bad_words.get(words)
        if found is not None:
            self._bad_words.move_to_end(words)
            return found
        vocab = self.model_config.vocab_size
        found = []
        for w in words:
            seqs = bad_words_token_ids(self.tokenizer, [w])
            if not seqs:
                raise InvalidRequest(f"bad_words: {w[:40]!r} has no tokens", "bad_words")
            if max(max(s) for s in seqs) >= vocab:
                raise InvalidRequest(
                    f"bad_words: {w[:40]!r} holds a token outside this model's vocabulary", "bad_words"
                )
            found += [s for s in seqs if s not in found]
        if len(self._bad_words) >= 1024:
            self._bad_words.popitem(last=False)
        self._bad_words[words] = found
        return found

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise InvalidRequest(f"allowed token ids must be in [0, {vocab})", "allowed_token_ids")
        if params.reasoning_token_ids and max(params.reasoning_token_ids) >= vocab:
            raise InvalidRequest(f"reasoning token ids must be in [0, {vocab})", "reasoning_token_ids")
        if params.lora_adapter is not None:
            if self.lora is None:
                raise InvalidRequest(
                    "this worker serves no LoRA adapters (it was started without --enable-lora)", "model"
                )
            if params.lora_adapter not in self.lora.adapters:
                raise InvalidRequest(
                    f"the LoRA adapter {params.lora_adapter} is not loaded on this worker (adapters: "
                    f"{sorted(self.lora.adapters)})",
                    "model",
                )
        if params.bad_words:
            self.bad_words_ids(tuple(params.bad_words))  # tokenized and checked here, not in a step
        if params.structured_outputs is not None:  # a grammar that does not compile: 400 here
            self.structured.compile(params.structured_outputs)  # (cached: the servers compiled it already)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens", "prompt"
            )
        # More than the context leaves after the prompt is served up to the context (finish
        # reason "length"), as vLLM does; more than the whole context is a mistake.
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"max_tokens ({params.max_tokens}) is more than this model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
        # A request must be able to finish alone, or preemption could cycle forever.
        longest = min(self.max_model_len, len(ids) + (params.max_tokens or self.max_model_len))
        if self.block_manager.blocks_needed(longest) > self.block_manager.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens ({longest} tokens) needs more KV blocks than the "
                f"pool holds ({self.block_manager.num_blocks} x {self.block_manager.block_size})",
                "max_tokens",
            )
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and len(ids) > sc.max_num_batched_tokens:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) with chunked prefill off",
                "prompt",
            )

    def expire_reservations(self, now: float | None = None) -> list[str]:
        """Free the blocks of reservations whose KV and activation never came (lease expired)."""
        now = time.monotonic() if now is None else now
        gone = [rid for rid, deadline in self._reserved.items() if now > deadline]
        for rid in gone:
            self._reserved.pop(rid, None)
            self.abort_request(rid)
        self._drain_senders_done()
        if self.block_manager.fenced:
            self.block_manager.release_fenced(time.monotonic(), self._senders_done.keys())
        return gone

    def _drain_senders_done(self) -> None:
        """Note the transfers whose in-place sender said it is done with them (receivers' threads
        append; read here on the engine thread): their blocks need no fence, or no longer."""
        for receiver in self._in_place_receivers:
            while receiver.senders_finished:
                self._senders_done[receiver.senders_finished.popleft()] = None
        while len(self._senders_done) > 4096:
            self._senders_done.popitem(last=False)

    def abort_request(self, request_id: str) -> bool:
        pending = self._pending_reserve.pop(request_id, None)
        if pending is not None:  # still waiting for room: it never got any
            pending[2](None)
            return True
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = FinishReason.ABORT
        fence = self._stop_receiving(request_id)  # before _finish frees the blocks
        self._reserved.pop(request_id, None)
        if self.bridge is not None:  # a prefill cut short: its KV transfer ends here too
            self.bridge.abort(request_id, "the request was aborted on the prefill worker")
        if fence:
            self.block_manager.fence(request_id, fence)  # _finish then frees nothing
        self._finish(seq)
        return True

    def _stop_receiving(self, request_id: str) -> float:
        """No more KV may land in this reservation's blocks through the receiver: when this
        returns, it has written its last byte there (it drops the rest of a frame on its way).
        A sender that writes into them itself (shared memory, NIXL) is not stopped by it:
        returns until when (monotonic) the blocks must stay fenced, 0 if they need not."""
        receiver = self._receivers.pop(request_id, None)
        until = self._in_place.pop(request_id, 0.0)
        if receiver is None:
            return 0.0
        if until and receiver.is_complete(request_id):
            until = 0.0  # all its KV is in: the sender has nothing more to write
        receiver.cancel(request_id)
        if until:
            self._drain_senders_done()
            if request_id in self._senders_done:  # its sender aborted it already: nothing more comes
                until = 0.0
        return until if until > time.monotonic() else 0.0

    def has_unfinished_requests(self) -> bool:
        if self.scheduler.has_unfinished():
            return True
        self._idle = True
        return False

    # ---- step observers: the one place steps are timed
    def add_step_observer(self, fn: Callable[[StepRecord], None]) -> None:
        """Have `fn(StepRecord)` called after every step that ran something (on the engine thread)."""
        self._step_observers.append(fn)

    def remove_step_observer(self, fn: Callable[[StepRecord], None]) -> None:
        if fn in self._step_observers:
            self._step_observers.remove(fn)

    # ---- the step
    def _move_tiers(self) -> None:
        """Hand the KV store the blocks the pool evicted or registered since the last call,
        while their data is intact (before anything writes into reused blocks)."""
        evicted, registered = self.block_manager.drain_tier_moves()
        if evicted:
            self.kv_store.offload([BlockRef(*e) for e in evicted])
        if registered:
            self.kv_store.publish([BlockRef(*r) for r in registered])

    def _finish_tier_loads(self) -> None:
        for done in self.kv_store.finished_loads():
            self.scheduler.remote_kv_done(done.seq_id, done.num_blocks * self.block_manager.block_size)

    def _start_tier_loads(self, sched) -> None:
        """After the schedule: copy out what it evicted, then start the loads it admitted."""
        self._move_tiers()
        bm = self.block_manager
        for seq, start, n in sched.loads:
            sb = bm.seqs[seq.seq_id]
            first = start // bm.block_size
            blocks = [
                BlockRef(
                    sb.blocks[i].block_id,
                    sb.hashes[i],
                    tuple(seq.all_token_ids[i * bm.block_size : (i + 1) * bm.block_size]),
                )
                for i in range(first, first + n // bm.block_size)
            ]
            self.kv_store.start_load(seq.seq_id, blocks)

    def step(self) -> list[RequestOutput]:
        """Run one step; an output per request that got a token. Timed here, for the step
        observers, when there are any."""
        if not self._step_observers:
            self._idle = False
            return self._step()
        t0, c0 = time.monotonic(), time.thread_time()
        outputs = self._step()
        t1, c1 = time.monotonic(), time.thread_time()
        idle, self._idle = self._idle, False
        sched = self.last_schedule
        if sched is not None and sched.scheduled:
            rec = StepRecord(t0, t1, c1 - c0, step_rows(sched), idle, self.calibrating)
            for fn in list(self._step_observers):
                fn(rec)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.kv_store is not None:
            self._finish_tier_loads()
        sched = self.last_schedule = self.scheduler.schedule()
        if self.kv_store is not None:
            self._start_tier_loads(sched)
        if sched.empty:
            if self.kv_store is not None and self.kv_store.pending_loads:
                self.kv_store.wait_for_loads(0.005)  # nothing to run until a load lands
            return []
        hook = self.bridge.layer_hook(sched.scheduled, self.runner, self.block_manager) if self.bridge else None
        logits, rows, prompt_logits, spec = self.runner.execute(sched, self.block_manager, on_layer_done=hook)
        for seq, first_pos, lg in prompt_logits:
            record_prompt_logprobs(seq, first_pos, lg)
        if self.bridge is not None:
            self.bridge.after_step(sched.scheduled, self.runner, self.block_manager)
        sampled = []
        if rows:
            seqs = [r.seq for r in rows]
            result = self.sampler(
                logits,
                [s.params for s in seqs],
                [s.seq_id for s in seqs],
                [(s.prompt_token_ids, s.output_token_ids) for s in seqs],
            )
            sampled = [SampledToken(seq, tok, lp) for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)]
        had = None
        if spec is not None:
            sampled += self._verify(*spec)
            had = {id(x.seq): (x.seq, len(x.seq.output_token_ids)) for x in sampled}
        upd = self.scheduler.update_from_output(sched, sampled, time.monotonic(), self._detokenize)
        self.num_prompt_tokens_computed += upd.num_prompt_tokens
        for seq in upd.finished:
            self._forget(seq)
        if spec is None:
            outputs = [self._output(x.seq, [x.token]) for x in sampled]
        else:  # a verified sequence got several tokens (up to one that ended it): one output
            outputs = [self._output(seq, seq.output_token_ids[n:]) for seq, n in had.values()]
        if self._pending_reserve:  # finished sequences may have made room
            self.retry_reservations()
        return outputs

    def _verify(self, logits: torch.Tensor, spec_rows: list) -> list[SampledToken]:
        """The tokens the drafts of a step's spec rows come to (spec_decode.verify); each row
        learns how many of its drafts were refused, for the scheduler's bookkeeping."""
        seqs = [r.seq for r in spec_rows]
        results = verify(self.sampler, logits, seqs, [r.spec_token_ids for r in spec_rows])
        sampled = []
        for r, v in zip(spec_rows, results):
            r.num_rejected = len(r.spec_token_ids) - v.num_accepted
            self.spec_stats.record(len(r.spec_token_ids), v.num_accepted)
            self.drafter.observe(r.seq.seq_id, len(r.spec_token_ids), v.num_accepted)
            sampled.extend(SampledToken(r.seq, tok, lp) for tok, lp in zip(v.tokens, v.logprobs))
        return sampled

    def _detokenize(self, seq: Sequence, token: int) -> str:
        return self._detok[seq.seq_id].step([token])

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        """Drop the engine's own state of a finished sequence (the scheduler has let it go)."""
        self.sampler.forget(seq.seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        self._detok.pop(seq.seq_id, None)
        self._receivers.pop(seq.seq_id, None)
        self._in_place.pop(seq.seq_id, None)
        # keep finished sequences out of the table so ids can be reused and memory stays flat
        self.seqs.pop(seq.seq_id, None)

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        finished = seq.is_finished
        # While a stop string could still be completing, hold back its length - 1 chars:
        # a stream must never send text that the stop string later removes.
        emitted = seq.emitted_text_len
        hold = max((len(s) for s in seq.params.stop), default=1) - 1 if not finished else 0
        end = max(emitted, len(seq.text) - hold)
        delta = seq.text.tail(emitted)[: end - emitted]
        seq.emitted_text_len = end
        want_lp = seq.params.logprobs is not None
        if finished:  # the whole completion, once
            comp = CompletionOutput(
                index=0,
                text=str(seq.text),
                token_ids=list(seq.output_token_ids),
                logprobs=list(seq.logprobs) if want_lp else None,
            )
        else:  # only what is new: a step costs the same at the 10,000th token as at the 10th
            comp = CompletionOutput(
                index=0,
                text=delta,
                token_ids=list(new_ids),
                logprobs=seq.logprobs[-len(new_ids) :] if want_lp else None,
            )
        comp.cumulative_logprob = seq.cumulative_logprob if want_lp else None
        # the prompt's logprobs: with the first output (all computed by then) and the final one
        prompt_lps = prompt_ranks = None
        if seq.params.prompt_logprobs is not None and not seq.needs_prompt_logprobs:
            if finished or len(seq.output_token_ids) == len(new_ids):
                prompt_lps, prompt_ranks = list(seq.prompt_logprobs), list(seq.prompt_logprob_ranks)
        if self.logprob_objects and finished:  # the offline API's form (vLLM's Logprob), not the servers'
            if comp.logprobs is not None:
                ranks = seq.logprob_ranks[-len(comp.logprobs) :] if comp.logprobs else []
                comp.logprobs = as_logprobs(comp.logprobs, ranks, self._token_text)
            if prompt_lps is not None:
                prompt_lps = as_logprobs(prompt_lps, seq.prompt_logprob_ranks, self._token_text)
        comp.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        comp.stop_reason = seq.stop_reason
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            new_token_ids=new_ids,
            new_text=delta,
            metrics={
                "arrival_time": seq.arrival_time,
                "first_scheduled_time": seq.first_scheduled_time,
                "first_token_time": seq.first_token_time,
                "last_token_time": seq.last_token_time,
                "num_preemptions": seq.num_preemptions,
            },
            prompt_logprobs=prompt_lps,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprob_ranks=prompt_ranks,
        )

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ---- introspection
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_fenced_blocks": bm.num_fenced_blocks,  # given up, held from a sender that may write
            "num_blocks": bm.num_blocks,
            "prefix_cache_queries_tokens": bm.stats.queries_tokens,
            "prefix_cache_hits_tokens": bm.stats.hits_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            **(self.spec_stats.as_dict() if self.drafter is not None else {}),
            **({"kv_store": self.kv_store.stats()} if self.kv_store is not None else {}),
            **({"lora": self._lora_stats()} if self.lora is not None else {}),
        }

    def _lora_stats(self) -> dict:
        """The adapters of the running and the waiting requests, by name (vLLM's lora_requests_info)."""
        names = {k: n for n, k in self.lora.names().items()}

        def of(seqs):
            keys = {s.params.lora_adapter for s in seqs if s.params.lora_adapter is not None}
            return sorted(names.get(k, k.rsplit("@", 1)[0]) for k in keys)

        return {
            "running": of(self.scheduler.running),
            "waiting": of(self.scheduler.waiting.unordered()),
            "max_lora": self.config.lora.max_loras,
        }

    def close(self) -> None:
        """Stop the KV store's threads. With a tier that outlives the process (disk), the
        prefixes the pool still caches are saved first, most recent first, so that a restart
        finds them: a prefix whose first blocks stayed in the pool would otherwise miss whole."""
        if self.kv_store is None:
            return
        try:
            if any(t.persistent for t in self.kv_store.local):
                self._move_tiers()
                bm = self.block_manager
                # most recently used first: blocks in use, then the free queue from its young end,
                # where a freed sequence's head block lands after its tail (a prefix's head first)
                in_use = [b for b in bm.cached.values() if b.ref_cnt > 0]
                idle = [bm.blocks[i] for i in reversed(bm.free_queue) if bm.blocks[i].block_hash is not None]
                refs = [BlockRef(b.block_id, b.block_hash, b.token_ids) for b in in_use + idle if b.token_ids]
                saved = self.kv_store.save_all(refs)
                log.info("closing: %d cached blocks of the pool saved to the KV store's tiers", saved)
        except Exception:  # a failed device (the step that failed): the store still closes
            log.exception("closing: saving the pool's cached blocks failed")
        finally:
            self.kv_store.close()


def record_prompt_logprobs(seq: Sequence, first_pos: int, logits: torch.Tensor, rows_at_once: int = 256) -> None:
    """Append to `seq.prompt_logprobs` what the logits at prompt positions `first_pos`, ... say
    of the prompt tokens that follow them: that token's logprob, then the top ones. A few rows
    at a time: a long chunk's log-softmax over a large vocabulary would otherwise be a second
    copy of all its logits."""
    k = seq.params.prompt_logprobs
    for r0 in range(0, logits.shape[0], rows_at_once):
        lps = torch.log_softmax(logits[r0 : r0 + rows_at_once].float(), dim=-1)
        at = first_pos + r0 + 1
        nxt = torch.tensor(seq.prompt_token_ids[at : at + lps.shape[0]], device=lps.device)
        own_t = lps.gather(1, nxt[:, None])
        own = own_t[:, 0].tolist()
        seq.prompt_logprob_ranks.extend((lps >= own_t).sum(dim=1).tolist())  # ties against it, as vLLM
        top_v, top_i = lps.topk(k, dim=-1) if k else (None, None)
        for r, (tok, lp) in enumerate(zip(nxt.tolist(), own)):
            entry = {tok: lp}
            if k:
                entry.update((i, v) for i, v in zip(top_i[r].tolist(), top_v[r].tolist()) if i != tok)
            seq.prompt_logprobs.append(entry)
