"""The fused bf16 elementwise kernels against the PyTorch ops they replace, both implementations:
the C++ ones (elementwise.cpp, the CPU) and the Triton ones (triton_elementwise.py, the GPU; here
under Triton's interpreter), and a tiny model's greedy tokens in bf16 with and without them."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are first imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.engine import cpu_kernels  # noqa: E402
from pdserve.engine.model import rotate_half  # noqa: E402
from tests.tiny import write_tiny_model  # noqa: E402

kernels = cpu_kernels.load()
BF16 = torch.bfloat16


def triton_elementwise():
    pytest.importorskip("triton", reason="triton is not installed")
    from pdserve.engine.triton_elementwise import TritonElementwise

    return TritonElementwise()


@pytest.fixture(params=["cpp", "triton"])
def ew(request):
    if request.param == "cpp":
        if kernels is None:
            pytest.skip("C++ kernels could not be built here")
        return kernels
    return triton_elementwise()


needs_cpp = pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed values (bit patterns as ordered integers)."""

    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_near(got: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1):
    """At most `max_ulps` bf16 steps apart anywhere, and nearly all elements equal:
    only the fp32 sum order and exp differ from PyTorch, in their last bits."""
    d = ulps(got, ref)
    assert d.max().item() <= max_ulps, d.max()
    assert (d == 0).float().mean().item() >= 0.98


def rand(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(BF16)


def rms_norm_ref(x, weight, eps):  # the model's RMSNorm in bf16
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(BF16)


@pytest.mark.parametrize("rows, width", [(1, 1), (3, 7), (5, 16), (37, 33), (64, 576)])
def test_rms_norm(ew, rows, width):
    x, w = rand(rows, width, scale=3), 1 + rand(width, scale=0.1)
    before = x.clone()
    assert_near(ew.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), max_ulps=2)
    assert torch.equal(x, before)


@pytest.mark.parametrize("rows, width", [(1, 1), (3, 7), (5, 16), (37, 33), (64, 576)])
def test_add_rms_norm_updates_the_residual_in_place(ew, rows, width):
    x, residual, w = rand(rows, width), rand(rows, width, scale=4), 1 + rand(width, scale=0.1)
    x_before, summed = x.clone(), residual + x  # a bf16 add: one rounding, as the kernel's
    out = ew.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, summed) and torch.equal(x, x_before)
    assert_near(out, rms_norm_ref(summed, w, 1e-6), max_ulps=2)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(3, 1, 2), (2, 2, 6), (4, 2, 64), (3, 1, 80)])
def test_rope_qkv_matches_rotate_half(ew, heads, kv_heads, head_dim):
    """Same roundings as the PyTorch path (cos/sin cast to bf16, each product and the sum
    rounded): bit-identical. head_dim 80: 40 pairs, vectors and a tail. k is rotated in
    place, q into a contiguous tensor of its own."""
    rows, max_pos = 29, 300
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((torch.outer(torch.arange(max_pos).float(), inv),) * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, max_pos, (rows,))
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim, scale=2)
    q_ref, k_ref, v_ref = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    c, s = cos[positions].to(BF16).unsqueeze(1), sin[positions].to(BF16).unsqueeze(1)
    q_ref, k_ref = (t.reshape(rows, -1, head_dim) for t in (q_ref, k_ref))
    q_ref, k_ref = q_ref * c + rotate_half(q_ref) * s, k_ref * c + rotate_half(k_ref) * s

    q, k, v = ew.rope_qkv(qkv, cos, sin, positions, heads, kv_heads, head_dim)
    assert q.shape == (rows, heads, head_dim) and k.shape == v.shape == (rows, kv_heads, head_dim)
    assert q.is_contiguous()
    k_at = qkv[:, heads * head_dim :].data_ptr()
    assert k.data_ptr() == k_at and v.data_ptr() == k_at + kv_heads * head_dim * 2  # views of qkv
    assert torch.equal(qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view_as(k), k_ref)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_ref.view(rows, kv_heads, head_dim))


@needs_cpp
def test_rope_qkv_rejects_a_position_outside_the_table():
    table = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="outside the rope table"):
        kernels.rope_qkv(rand(2, 12), table, table, torch.tensor([0, 8]), 1, 1, 4)


@pytest.mark.parametrize("rows, inter", [(1, 1), (4, 15), (3, 17), (37, 100), (64, 1536)])
def test_silu_and_mul(ew, rows, inter):
    gate_up = rand(rows, 2 * inter, scale=6)  # far into both tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    assert_near(ew.silu_and_mul(gate_up), F.silu(gate) * up)


@needs_cpp
@pytest.mark.parametrize("bad", [rand(4, 6).float(), rand(4, 6).t(), rand(24)])
def test_kernels_reject_other_layouts(bad):
    with pytest.raises(RuntimeError, match="contiguous 2-D bfloat16"):
        kernels.silu_and_mul(bad)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_tiny_model_tokens_with_and_without_the_kernels(tmp_path, backend):
    """bf16 end to end (no GGUF: every step on the layer-by-layer path, prefill and decode
    batches); head_dim 64 and hidden 128 take the C++ kernels' vector loops. The Triton
    attention backend takes the Triton elementwise kernels (what a GPU runs)."""
    if backend == "cpp" and kernels is None:
        pytest.skip("C++ kernels could not be built here")
    if backend == "triton":
        triton_elementwise()
    d = write_tiny_model(str(tmp_path / "m"), hidden=128, heads=2, kv_heads=1, inter=256, seed=5, logit_scale=4)
    prompts = ["hello world", "the quick brown fox jumps over the lazy dog " * 4, "x", "0123456789" * 5]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    if backend == "triton":  # interpreted: slow, so fewer (still a prefill batch and decode batches)
        prompts, greedy.max_tokens = prompts[:2], 8
    llm = LLM(d, dtype="bfloat16", block_size=4, num_gpu_blocks=256, attention_backend=backend)
    model = llm.engine.runner.model
    chosen = model.elementwise_kernels(torch.zeros(1, 128, dtype=BF16))
    assert chosen is kernels if backend == "cpp" else type(chosen).__name__ == "TritonElementwise"
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    model.fused_elementwise = False
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    same = sum(a == b for f, p in zip(fused, plain) for a, b in zip(f, p))
    assert same >= 0.9 * sum(map(len, plain)), (fused, plain)
