"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Qwen3, Mistral) over a paged KV cache.

The model sees one flattened batch of tokens per step: decode tokens of many
sequences and prefill chunks of others, side by side. Attention reads and
writes the paged cache through `AttentionMetadata`, built by the model runner.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.engine.attention import AttentionMetadata, paged_attention

Q8_MAX_K = 8192  # widest input the int8-activation kernel takes (gguf_matmul.cpp, kMaxNb blocks of 32)


class Linear(nn.Linear):
    """nn.Linear that multiplies GGUF quantized blocks directly for a few fp32 rows.

    Decode steps read every weight once per step; reading the file's 4.5-bit
    blocks instead of their fp32 expansion is what makes small batches fast.
    Large batches (prefill) stay on the dense GEMM (fp32, or bf16 in bf16 mode),
    which is compute-bound. Where they cross depends on the GEMM (`gguf_rows_limit`):
    against fp32 up to 16 rows the block kernel wins (one core, decode step of 16 rows
    at 256 context: 186 ms of CPU time vs 260 ms on the dense fp32 path; at 32 they
    tie); against oneDNN's bf16 GEMM on prepacked weights only up to 2. SmolLM2's
    120 products alone, 2 threads, Zen 5, GGUF vs bf16: 1 row 3.7 vs 6.4 ms, 4 rows
    8.4 vs 8.3, 8 rows 13.4 vs 7.3, 16 rows 23.5 vs 9.1; whole decode steps at 128
    tokens of context (the fused layer vs the layer-by-layer path): batch 1 5.0 vs
    9.7 ms, 2 10-11 vs 10, 4 16 vs 10.6, 8 31 vs 12.7, 16 48 vs 16.7. In bf16 mode the
    block kernel still computes in fp32 (the GGUF values exactly) and its output is
    rounded to the model's dtype.

    With int8 activations (the default of `dtype="auto"` on an AVX2 CPU, where fp32
    is the fastest float GEMM) products of more than `max_rows` rows go to the int8
    GEMM too (`int8_gemm.cpp`): the activations rounded to int8 per 32 values, the
    weights the file's own blocks, repacked once into `gemm_weight`. Not
    token-identical to fp32; its agreement is in docs/performance.md.
    """

    qweight: torch.Tensor | None = None
    qtype: int = 0
    kernel = None
    max_rows: int = 16
    int8_activations: bool = False  # qweight is then q8_repack's layout, multiplied by q8_matmul
    packed: torch.Tensor | None = None  # the bf16 weight in oneDNN's blocked layout (`pack_dense`)

    gemm_weight: torch.Tensor | None = None  # int8 mode in fp32: q8_gemm_pack's tiles for many rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and x.shape[0] <= self.max_rows:
            mm = self.kernel.q8_matmul if self.int8_activations else self.kernel.gguf_matmul
            y = mm(x.float().contiguous(), self.qweight, self.qtype, self.in_features)
            if self.bias is not None:
                y = y + self.bias
            return y.to(x.dtype)
        if self.gemm_weight is not None and x.dim() == 2:
            y = self.kernel.q8_gemm(
                x.float().contiguous(), self.gemm_weight, self.qtype, self.in_features, self.out_features
            )
            if self.bias is not None:
                y = y + self.bias
            return y.to(x.dtype)
        if self.packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def pack_dense(self, rows_hint: int = 64) -> bool:
        """Keep a copy of the bf16 weight in oneDNN's own blocked layout, so each many-row
        product skips re-laying the weight out (as vLLM's CPU backend and torch.compile do):
        ~1.25x on this model's 64-row GEMMs, ~1.07x at 256 rows. Costs the weight's bytes again."""
        if (
            self.weight.dtype != torch.bfloat16
            or self.weight.device.type != "cpu"
            or not torch.backends.mkldnn.is_available()
        ):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows_hint)
        except (RuntimeError, AttributeError):  # a torch build without the op: the plain GEMM
            self.packed = None
        return self.packed is not None

    def set_quantized(self, blocks: list[tuple[int, torch.Tensor]], kernel, int8_activations: bool = False) -> bool:
        """Use these raw block rows (one entry per fused part) if they share one type."""
        if len({t for t, _ in blocks}) != 1 or self.weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        self.qtype = blocks[0][0]
        self.qweight = torch.cat([raw for _, raw in blocks], dim=0).contiguous()
        # the int8 kernel keeps a row's block scales on the stack: K up to Q8_MAX_K; a wider
        # product (a big model's down_proj) stays on the fp32-activation kernel
        int8_activations = int8_activations and self.in_features <= Q8_MAX_K
        if int8_activations and self.weight.dtype == torch.float32 and hasattr(kernel, "q8_gemm"):
            # many rows too (prefill, batched decode): where fp32 is the fastest float GEMM (no
            # native bf16), int8 products run ~1.5-2x faster (csrc/int8_gemm.cpp); in bf16 mode the
            # bf16 GEMM is faster still and stays
            self.gemm_weight = kernel.q8_gemm_pack(self.qweight, self.qtype, self.in_features)
        if int8_activations:
            self.qweight = kernel.q8_repack(self.qweight, self.qtype, self.in_features)
        self.int8_activations = int8_activations
        self.kernel = kernel
        return True


def gguf_rows_limit(dtype: torch.dtype, int8_activations: bool = False) -> int:
    """How many rows a product may have and still run on the GGUF blocks (`Linear.max_rows`)
    by default: 16 beside an fp32 GEMM (or int8 activations, whose many-row GEMM is also
    the file's blocks), 2 beside a bf16 one (measured in `Linear`'s docstring)."""
    return 2 if dtype == torch.bfloat16 and not int8_activations else 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementation does, whatever the dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 / linear rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        # q, k, v fused into one matmul; gate and up likewise.
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Qwen3: each head of q and of k normalised (one weight shared by the heads) before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.fused = None  # C++ DecodeLayer over the same weights, when every linear is quantized

    def make_fused(self, kernel, config: ModelConfig) -> bool:
        """Build the one-call C++ decode layer if all four products run on GGUF blocks."""
        lins = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        if any(lin.qweight is None for lin in lins) or not hasattr(kernel, "DecodeLayer"):
            return False
        if len({lin.int8_activations for lin in lins}) > 1:  # the C++ layer takes one mode for all four
            return False
        bias = self.qkv_proj.bias.detach() if self.qkv_proj.bias is not None else None
        qk_norms = [n.weight.detach().float() if n is not None else None for n in (self.q_norm, self.k_norm)]
        self.fused = kernel.DecodeLayer(  # fp32 norms (copies in bf16 mode)
            self.input_layernorm.weight.detach().float(),
            self.post_attention_layernorm.weight.detach().float(),
            self.qkv_proj.qweight,
            self.qkv_proj.qtype,
            bias,
            self.o_proj.qweight,
            self.o_proj.qtype,
            self.gate_up_proj.qweight,
            self.gate_up_proj.qtype,
            self.down_proj.qweight,
            self.down_proj.qtype,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            self.qkv_proj.int8_activations,
            *qk_norms,
        )
        return True

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        lora, i = meta.lora, self.layer_idx
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h) if lora is None else lora.add(i, "qkv", h, self.qkv_proj(h))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv, self.head_dim)
        v = v.view(t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = paged_attention(q, k, v, kv_cache, meta, self.layer_idx).reshape(t, self.q_size)
        if lora is None:
            x = x + self.o_proj(attn)
            gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
            return x + self.down_proj(F.silu(gate) * up)
        x = x + lora.add(i, "o", attn, self.o_proj(attn))
        h = self.post_attention_layernorm(x)
        gate, up = lora.add(i, "gate_up", h, self.gate_up_proj(h)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return x + lora.add(i, "down", act, self.down_proj(act))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with its q and k heads normalised (Qwen3), for a RoPE kernel that takes all three."""
        t, q_end = qkv.shape[0], self.q_size
        k_end = q_end + self.kv_size
        q = self.q_norm(qkv[:, :q_end].reshape(t, self.n_heads, self.head_dim)).reshape(t, q_end)
        k = self.k_norm(qkv[:, q_end:k_end].reshape(t, self.n_kv, self.head_dim)).reshape(t, self.kv_size)
        return torch.cat((q, k, qkv[:, k_end:]), dim=-1)

    def forward_fused_elementwise(self, x, residual, positions, rope_tables, kv_caches, meta: AttentionMetadata, ew):
        """`forward` for bf16 rows on the CPU, its elementwise steps in `ew`'s C++ kernels.

        As vLLM does, the residual add is deferred into the next norm: `x` is the previous
        layer's output still to be added to the running sum `residual` (None for the
        first layer, whose input is `residual` itself), which is updated in place.
        Returns this layer's output, to be added by the next norm."""
        t = x.shape[0] if x is not None else residual.shape[0]
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        h = (
            ew.rms_norm(residual, ln1.weight, ln1.eps)
            if x is None
            else ew.add_rms_norm(x, residual, ln1.weight, ln1.eps)
        )
        lora, i = meta.lora, self.layer_idx
        qkv = self.qkv_proj(h) if lora is None else lora.add(i, "qkv", h, self.qkv_proj(h))
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        q, k, v = ew.rope_qkv(qkv, *rope_tables, positions, self.n_heads, self.n_kv, self.head_dim)
        attn = paged_attention(q, k, v, kv_caches, meta, self.layer_idx).reshape(t, self.q_size)
        o = self.o_proj(attn) if lora is None else lora.add(i, "o", attn, self.o_proj(attn))
        h = ew.add_rms_norm(o, residual, ln2.weight, ln2.eps)
        if lora is None:
            return self.down_proj(ew.silu_and_mul(self.gate_up_proj(h)))
        act = ew.silu_and_mul(lora.add(i, "gate_up", h, self.gate_up_proj(h)))
        return lora.add(i, "down", act, self.down_proj(act))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_rope_tables(None)
        self.fused_ready = False
        self.cpu_kernels = None  # the C++ CPU kernels, where the runner loaded them (`use_cpu_kernels`)
        self.gguf_max_rows = Linear.max_rows  # decode steps of at most this many rows take the fused layers
        self.fused_elementwise = True  # bf16: the fused elementwise kernels (C++ or Triton) when there are some
        self.triton_elementwise = None  # triton_elementwise.TritonElementwise, set by a runner on the Triton backend

    def tie_weights(self) -> None:
        """Share the embedding with the output head; call again after moving the model."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rope_tables(self, device) -> None:
        inv_freq = rope_inv_freq(self.config).to(device)
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device=device)
        emb = torch.cat((torch.outer(pos, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step; returns logits for `logits_indices` (all tokens if None)."""
        x = self.embed_tokens(input_ids)
        fused = self.use_fused(x, meta, kv_caches)
        if self.cpu_kernels is not None:
            # the fused layers run only pdserve's kernels: its pool, which never waits for a
            # descheduled thread; other steps also run oneDNN's GEMMs and torch's ops on
            # OpenMP's team, whose spinning threads the pool's helpers would take turns with
            self.cpu_kernels.set_parallel_mode("pool" if fused else "omp")
        if fused:
            # fp32 through the fused layers in either mode (bf16 mode: the block kernels are
            # fp32 anyway, the K/V written to the bf16 cache are rounded)
            x = x.float()
            cos, sin = self.cos_table[positions].float(), self.sin_table[positions].float()
            lora = meta.lora
            for layer in self.layers:
                k_cache, v_cache = kv_caches[layer.layer_idx]
                x = layer.fused.forward(
                    x,
                    cos,
                    sin,
                    k_cache,
                    v_cache,
                    meta.slot_mapping,
                    meta.decode_block_tables,
                    meta.decode_seq_lens,
                    lora.fused_args(layer.layer_idx) if lora is not None else [],
                )
                if meta.on_layer_done is not None:
                    meta.on_layer_done(layer.layer_idx)
            return self._logits(x, logits_indices)
        ew = self.elementwise_kernels(x)
        if ew is not None:
            return self._forward_fused_elementwise(x, positions, kv_caches, meta, logits_indices, ew)
        cos = self.cos_table[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(x.dtype).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_caches, meta)
            if meta.on_layer_done is not None:
                meta.on_layer_done(layer.layer_idx)
        return self._logits(x, logits_indices)

    def use_cpu_kernels(self, kernels) -> None:
        """The C++ CPU kernels this model's steps run: each step then tells them which threads
        their parallel loops take (`set_parallel_mode`)."""
        self.cpu_kernels = kernels if hasattr(kernels, "set_parallel_mode") else None

    def elementwise_kernels(self, x: torch.Tensor):
        """The fused elementwise kernels for bf16 rows, else None: the Triton ones where the
        runner set them (the Triton backend, on a GPU or interpreted), the C++ ones
        (elementwise.cpp) on the CPU.

        Only in bf16: there each PyTorch elementwise op is several slow passes over memory on a
        CPU and one launch of many on a GPU, while the fp32 path must stay op for op as
        transformers computes it."""
        if not self.fused_elementwise or x.dtype != torch.bfloat16:
            return None
        if self.triton_elementwise is not None:
            return self.triton_elementwise
        if x.device.type != "cpu":
            return None
        from pdserve.engine import cpu_kernels  # built (and cached) by the model runner already

        kernels = cpu_kernels.load()
        return kernels if hasattr(kernels, "add_rms_norm") else None

    def _forward_fused_elementwise(
        self, x, positions, kv_caches, meta: AttentionMetadata, logits_indices: torch.Tensor | None, ew
    ) -> torch.Tensor:
        """The layer-by-layer path with fused norms, residual adds, RoPE and SiLU * up."""
        residual, out = x, None  # the embeddings: a fresh tensor, so updating it in place is safe
        rope_tables = (self.cos_table, self.sin_table)
        for layer in self.layers:
            out = layer.forward_fused_elementwise(out, residual, positions, rope_tables, kv_caches, meta, ew)
            if meta.on_layer_done is not None:
                meta.on_layer_done(layer.layer_idx)
        if logits_indices is not None:  # the norm is per row: select the rows first
            out, residual = out[logits_indices], residual[logits_indices]
        return self.lm_head(ew.add_rms_norm(out, residual, self.norm.weight, self.norm.eps)).float()

    def use_fused(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches=None) -> bool:
        """A batch of only decode tokens, few enough for the GGUF path, on the CPU kernels:
        in fp32 mode the same arithmetic as the layer-by-layer path, in one C++ call per
        layer; in bf16 mode (bf16 KV cache) the activations stay fp32 inside the layer."""
        cache_ok = kv_caches is None or kv_caches[0][0].dtype in (torch.float32, torch.bfloat16)
        return (
            self.fused_ready
            and meta.decode_kernel is not None
            and not meta.prefills
            and cache_ok
            and meta.num_decodes == x.shape[0] <= self.gguf_max_rows
            and x.dtype in (torch.float32, torch.bfloat16)
        )

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.norm(x)).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face, fusing q/k/v and gate/up."""
        own = self.state_dict()
        cfg = self.config
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            fused = {
                f"layers.{i}.qkv_proj.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                f"layers.{i}.gate_up_proj.weight": [m + "gate_proj.weight", m + "up_proj.weight"],
            }
            if cfg.attention_bias:
                fused[f"layers.{i}.qkv_proj.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
            for dst, srcs in fused.items():
                _copy(own, dst, torch.cat([_take(state, s) for s in srcs], dim=0))
            _copy(own, f"layers.{i}.o_proj.weight", _take(state, a + "o_proj.weight"))
            _copy(own, f"layers.{i}.down_proj.weight", _take(state, m + "down_proj.weight"))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                _copy(own, f"layers.{i}.{norm}.weight", _take(state, f"{p}{norm}.weight"))
            if cfg.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    _copy(own, f"layers.{i}.{norm}.weight", _take(state, f"{a}{norm}.weight"))
        _copy(own, "embed_tokens.weight", _take(state, "model.embed_tokens.weight"))
        _copy(own, "norm.weight", _take(state, "model.norm.weight"))
        if not cfg.tie_word_embeddings:
            _copy(own, "lm_head.weight", _take(state, "lm_head.weight"))

    def load_quantized(
        self,
        quantized: dict[str, tuple[int, torch.Tensor]],
        kernel,
        int8_activations: bool = False,
        max_rows: int | None = None,
    ) -> int:
        """Give each linear layer its GGUF blocks; returns how many layers use them.
        With int8_activations every block product rounds its activations to int8. Products
        of at most `max_rows` rows run on them (default: `gguf_rows_limit`)."""
        if max_rows is None:
            max_rows = gguf_rows_limit(self.embed_tokens.weight.dtype, int8_activations)
        self.gguf_max_rows = max_rows

        def parts(*names):
            return [quantized[n] for n in names] if all(n in quantized for n in names) else None

        used = 0
        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for lin, names in (
                (layer.qkv_proj, (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")),
                (layer.o_proj, (a + "o_proj.weight",)),
                (layer.gate_up_proj, (m + "gate_proj.weight", m + "up_proj.weight")),
                (layer.down_proj, (m + "down_proj.weight",)),
            ):
                blocks = parts(*names)
                used += bool(blocks and lin.set_quantized(blocks, kernel, int8_activations))
                lin.max_rows = max_rows
        head = parts("model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight")
        used += bool(head and self.lm_head.set_quantized(head, kernel, int8_activations))
        self.lm_head.max_rows = max_rows
        import os

        if not os.environ.get("PDSERVE_NO_FUSED_DECODE"):
            self.fused_ready = all([layer.make_fused(kernel, self.config) for layer in self.layers])
        return used


def checkpoint_weight_names(cfg: ModelConfig) -> set[str]:
    """Every checkpoint weight name `LlamaModel.load_hf_state_dict` reads for this shape
    (lm_head.weight too, which a tied model may or may not carry)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"self_attn.{n}_proj.weight" for n in "qkvo"]
    per_layer += [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    if cfg.attention_bias:
        per_layer += [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return {f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in per_layer} | names


def _take(state, name):
    if name not in state:
        raise KeyError(f"weight {name!r} missing from the checkpoint")
    return state[name]


def _copy(own, name, value):
    if own[name].shape != value.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != model {tuple(own[name].shape)}")
    own[name].copy_(value)
