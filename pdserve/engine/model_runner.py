"""Owns the model and the KV cache tensors; turns a scheduler output into one forward pass."""

from __future__ import annotations

import torch

from pdserve.config import ConfigError, EngineConfig, ModelConfig
from pdserve.engine.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.model import Linear, LlamaModel
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv.block_manager import BlockManager
from pdserve.kv.shm_files import new_kv_paths, sweep_stale_kv_files
from pdserve.kv.slots import slot_list


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, state_dict: dict, quantized: dict | None = None
    ):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device.device)
        self.dtype = config.device.torch_dtype
        self.block_size = config.cache.block_size
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches, CUDA graphs' side stream and index_select all use the current device
            torch.cuda.set_device(self.device)
        with torch.device("meta"):
            model = LlamaModel(model_config)
        # in the serving dtype before any memory is taken: an 8B model made in fp32 would take
        # 32 GB of GPU memory and a conversion pass before it shrank to its 16 GB of bf16
        model = model.to(self.dtype).to_empty(device=self.device)
        model.init_rope_tables(self.device)  # meta-device buffers hold no values
        model.tie_weights()
        model.load_hf_state_dict(state_dict)
        self.model = model.to(self.dtype).eval()
        self.model.tie_weights()
        # RoPE tables stay fp32 (`.to(dtype)` rounded them); each path casts what it uses,
        # as transformers computes cos/sin in fp32 and casts them to the activations' dtype
        self.model.init_rope_tables(self.device)
        self.decode_kernel = None
        self.kv_writer = None
        self.num_quantized_linears = 0
        self.num_packed_linears = 0
        self.attention_backend = self._attention_backend(model_config)
        if self.attention_backend == "triton":
            # imported here, not at module level: a CPU engine never loads triton
            from pdserve.engine.triton_attention import TritonAttentionBackend

            self.decode_kernel = TritonAttentionBackend()
            self.kv_writer = self.decode_kernel.write_kv
            if self.dtype == torch.bfloat16:
                from pdserve.engine.triton_elementwise import TritonElementwise

                self.model.triton_elementwise = TritonElementwise()
        elif self.device.type == "cpu" and self.attention_backend == "cpp":
            from pdserve.engine import cpu_kernels

            self.decode_kernel = cpu_kernels.load()
            self.model.use_cpu_kernels(self.decode_kernel)
            if self.decode_kernel is not None and quantized and config.use_gguf_kernels:
                self.num_quantized_linears = self.model.load_quantized(
                    quantized,
                    self.decode_kernel,
                    int8_activations=config.int8_activations,
                    max_rows=config.gguf_max_rows,
                )
        self.prefill_kernel = self._prefill_kernel(model_config)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            self.num_packed_linears = sum(m.pack_dense() for m in self.model.modules() if isinstance(m, Linear))
        self.num_blocks = config.cache.num_gpu_blocks or self._blocks_for_memory()
        self.kv_shape = [self.num_blocks, self.block_size, model_config.num_key_value_heads, model_config.head_dim]
        self.kv_shm_paths: list[str] = []
        if config.cache.kv_cache_shm_dir and self.device.type == "cpu":
            self.kv_caches = self._shared_caches(config.cache.kv_cache_shm_dir, model_config.num_hidden_layers)
        else:
            self.kv_caches = [
                (
                    torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device),
                    torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device),
                )
                for _ in range(model_config.num_hidden_layers)
            ]
        self.graphs = None  # cuda_graphs.DecodeGraphs, when decode steps replay CUDA graphs
        self.lora = None  # lora.LoRAManager, when the engine serves adapters
        if self.device.type == "cuda" and self.attention_backend == "triton" and not config.device.enforce_eager:
            self.enable_decode_graphs(capture=True)

    def _attention_backend(self, model_config: ModelConfig) -> str:
        """triton, cpp or torch, from the setting and the device.

        auto: triton on cuda (torch when the head dim does not fit the kernels), the C++ kernels
        on cpu (they fall back to torch themselves when they cannot be built)."""
        wanted = self.config.device.attention_backend
        if wanted == "auto":
            if self.device.type != "cuda":
                return "cpp"
            from pdserve.engine import triton_attention

            return "triton" if triton_attention.TritonAttentionBackend.supports(model_config.head_dim) else "torch"
        if wanted == "triton":
            from pdserve.engine import triton_attention

            if not triton_attention.TritonAttentionBackend.supports(model_config.head_dim):
                raise ConfigError(
                    f"--attention-backend triton needs a head dim that is a power of two >= 16; this model's "
                    f"is {model_config.head_dim} (auto would take torch)"
                )
        return wanted

    def _prefill_kernel(self, model_config: ModelConfig):
        """The C++ module if it runs this model's prefill attention: bf16 caches, and fp32 ones
        in int8 mode (exact fp32 stays on torch's SDPA, token-identical to transformers; fp16
        has no kernel). The triton backend runs every dtype's prefill spans."""
        if self.attention_backend == "triton":
            return self.decode_kernel
        k = self.decode_kernel
        inexact_fp32 = self.dtype == torch.float32 and self.config.int8_activations
        if (
            k is None
            or not (self.dtype == torch.bfloat16 or inexact_fp32)
            or not hasattr(k, "prefill_attention")
            or model_config.head_dim not in k.prefill_attention_head_dims
        ):
            return None
        return k

    def _shared_caches(self, directory: str, num_layers: int):
        """KV tensors backed by files [k0, v0, k1, v1, ...], removed when this process exits.

        Each file is made here, new (O_EXCL: never one someone else left in the shared
        directory, nor a link) and mode 0600: only this user's processes (a prefill worker
        of the same deployment) can map users' KV; torch then sizes and maps it."""
        import atexit
        import os

        sweep_stale_kv_files(directory)
        numel = 1
        for s in self.kv_shape:
            numel *= s
        maps = []
        for path in new_kv_paths(directory, num_layers):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            self.kv_shm_paths.append(path)
            maps.append(torch.from_file(path, shared=True, size=numel, dtype=self.dtype).view(self.kv_shape))
        caches = [(maps[2 * layer], maps[2 * layer + 1]) for layer in range(num_layers)]

        def cleanup(paths=tuple(self.kv_shm_paths)):
            for p in paths:
                try:
                    os.unlink(p)
                except OSError:
                    pass

        atexit.register(cleanup)
        return caches

    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Decode-only steps through `cuda_graphs.DecodeGraphs`: captured CUDA graphs, or with
        `capture=False` the same padded static-buffer path run eagerly (how a CPU test checks it)."""
        from pdserve.engine.cuda_graphs import DecodeGraphs

        mp = self.model_config.max_position_embeddings
        max_len = min(self.config.max_model_len or mp, mp)
        max_blocks = -(-max_len // self.block_size)
        self.graphs = DecodeGraphs(self, self.config.scheduler.max_num_seqs, max_blocks, capture=capture)
        self.graphs.capture_all()

    def _blocks_for_memory(self) -> int:
        per_token = self.model_config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        return max(1, self.config.cache.kv_cache_memory_bytes // (per_token * self.block_size))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def prepare(self, out: SchedulerOutput, kv: BlockManager):
        """Flatten the step: decode tokens first, then prefill spans.

        Returns (input_ids, positions, metadata, logits_indices, sampling rows, prompt rows,
        spec rows), where a sampling row is a scheduled entry that reached the end of its tokens
        and therefore samples a new one. A spec row is a decoding entry that brought drafted
        tokens (speculative decoding): it wants the logits of all its positions, the last
        real token's and each draft's; their indices follow the sampling rows'. A prompt row
        (seq, first position, count) asks for the logits of `count` prompt positions from
        `first position` on (prompt logprobs); their indices come last in `logits_indices`.
        """
        bs = self.block_size
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        ids, pos, slots = [], [], []
        logits_idx, rows = [], []
        spec_idx, spec_rows = [], []
        prompt_idx, prompt_rows = [], []
        dec_tables, dec_lens = [], []
        spans: list[tuple] = []
        lora_rows: list[tuple] = []  # (adapter key or None, first row, end row) per entry
        for group_idx, group in enumerate((decodes, prefills)):
            for s in group:
                seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
                table = kv.block_table(seq.seq_id)
                first = len(ids)
                if s.spec_token_ids:
                    ids.extend(seq.all_token_ids[start : start + n - len(s.spec_token_ids)])
                    ids.extend(s.spec_token_ids)
                    spec_idx.extend(range(first, first + n))
                    spec_rows.append(s)
                else:
                    ids.extend(seq.all_token_ids[start : start + n])
                if self.lora is not None:
                    lora_rows.append((seq.params.lora_adapter, first, len(ids)))
                pos.extend(range(start, start + n))
                slots.extend(slot_list(table, start, start + n, bs))
                if start + n == seq.num_tokens:
                    logits_idx.append(len(ids) - 1)
                    rows.append(s)
                if seq.needs_prompt_logprobs:
                    # position p predicts prompt token p + 1: those not recorded yet (a
                    # sequence recomputed after a preemption records each once)
                    lo = max(start, len(seq.prompt_logprobs) - 1)
                    hi = min(start + n, seq.num_prompt_tokens - 1)
                    if hi > lo:
                        prompt_idx.extend(range(first + lo - start, first + hi - start))
                        prompt_rows.append((seq, lo, hi - lo))
                if group_idx == 0:
                    dec_tables.append(table)
                    dec_lens.append(start + 1)
                else:
                    spans.append((first, len(ids), start + n, table))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), num_decodes=len(decodes)
        )
        meta.kv_writer = self.kv_writer
        if self.lora is not None:
            meta.lora = self.lora.batch(lora_rows)
        if decodes:
            width = max(len(t) for t in dec_tables)
            padded = [t + [0] * (width - len(t)) for t in dec_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            meta.decode_seq_lens = torch.tensor(dec_lens, dtype=torch.long, device=dev)
            meta.decode_kernel = self.decode_kernel
            if self.decode_kernel is None:
                positions = torch.arange(width * bs, device=dev)[None, :]
                meta.decode_mask = (positions < meta.decode_seq_lens[:, None])[:, None, None, :]
        if spans and self.prefill_kernel is not None:
            self._kernel_spans(meta, spans)
        else:
            meta.prefills = [self._torch_span(*s) for s in spans]
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        logits_idx = torch.tensor(logits_idx + spec_idx + prompt_idx, dtype=torch.long, device=dev)
        return input_ids, positions, meta, logits_idx, rows, prompt_rows, spec_rows

    def _torch_span(self, first: int, end: int, ctx: int, table: list[int]) -> PrefillSpan:
        """A span for torch's SDPA: its own K/V when it starts at position 0, else the
        cache blocks gathered through its table with a materialized causal mask."""
        dev = self.device
        span = PrefillSpan(first, end, ctx, None)
        if ctx > end - first:
            span.block_table = torch.tensor(table, dtype=torch.long, device=dev)
            q_pos = torch.arange(ctx - (end - first), ctx, device=dev)
            span.mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]
        return span

    def _kernel_spans(self, meta: AttentionMetadata, spans: list[tuple]) -> None:
        """All prefill spans as one prefill-kernel call: a span from position 0 reads its
        own K/V back from the cache like any other (written just before the call)."""
        meta.prefill_kernel = self.prefill_kernel
        meta.prefills = [PrefillSpan(first, end, ctx, None) for first, end, ctx, _ in spans]
        meta.prefill_spans = torch.tensor([[first, end, ctx] for first, end, ctx, _ in spans], dtype=torch.long)
        prepare = getattr(self.prefill_kernel, "prepare_spans", None)
        if prepare is not None:  # once a step, not once a layer (the triton kernels want them on the device)
            meta.prefill_spans = prepare(meta.prefill_spans, self.device)
        width = max(len(table) for *_, table in spans)
        meta.prefill_block_tables = torch.tensor(
            [table + [0] * (width - len(table)) for *_, table in spans], dtype=torch.long, device=self.device
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: BlockManager, on_layer_done=None):
        """Run the step; returns (logits for the sampling rows, those rows, prompt logits, spec
        logits): the third a list of (seq, first position, logits of that and the following
        positions), the last (logits of every position of the spec rows, one row after another,
        those rows) or None when the step has no drafts."""
        input_ids, positions, meta, logits_idx, rows, prompt_rows, spec_rows = self.prepare(out, kv)
        if (
            not prompt_rows
            and not spec_rows
            and meta.lora is None  # graphs are captured without adapters
            and self.graphs is not None
            and self.graphs.can_run(meta.num_decodes, input_ids.shape[0], on_layer_done)
        ):
            return self.graphs.run(input_ids, positions, meta, logits_idx), rows, [], None
        meta.on_layer_done = on_layer_done
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        at = len(rows)
        spec = None
        if spec_rows:
            n = sum(s.num_new_tokens for s in spec_rows)
            spec = (logits[at : at + n], spec_rows)
            at += n
        prompt_logits = []
        for seq, first_pos, count in prompt_rows:
            prompt_logits.append((seq, first_pos, logits[at : at + count]))
            at += count
        return logits[: len(rows)], rows, prompt_logits, spec
