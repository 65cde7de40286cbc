"""`dtype="auto"`: bf16 where the CPU computes it natively (AVX512-BF16 / AMX-BF16), else float32."""

import logging

import pytest

from pdserve.config import DeviceConfig, native_bf16

ZEN5 = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}
ZEN3 = {"avx2", "fma", "f16c"}
SKYLAKE_X = {"avx2", "avx512f", "avx512bw"}


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("PDSERVE_AUTO_DTYPE", raising=False)


@pytest.mark.parametrize(
    "flags,onednn,want",
    [
        (ZEN5, True, True),
        (SAPPHIRE_RAPIDS, True, True),
        (ZEN3, False, False),
        (SKYLAKE_X, True, False),  # AVX-512 without BF16: oneDNN would emulate
        (ZEN5, False, False),  # the CPU has it, this torch's oneDNN has no bf16 kernels
    ],
)
def test_native_bf16_from_cpu_flags(flags, onednn, want):
    got, why = native_bf16("cpu", flags=flags, onednn_bf16=onednn)
    assert got is want and why


def test_auto_says_why_and_explicit_float32_stays(monkeypatch):
    cfg = DeviceConfig(device="cpu", dtype="auto")
    assert cfg.dtype in ("float32", "bfloat16") and cfg.dtype_reason.startswith("auto: ")
    assert DeviceConfig(device="cpu", dtype="float32").dtype == "float32"
    monkeypatch.setenv("PDSERVE_AUTO_DTYPE", "float32")
    assert DeviceConfig(device="cpu", dtype="auto").dtype == "float32"


def test_start_up_log_names_the_dtype_and_why(tiny_model_dir, caplog):
    from pdserve import LLM

    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        LLM(tiny_model_dir, block_size=4, num_gpu_blocks=16)
    line = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    assert "auto: " in line and ("bfloat16" in line or "float32" in line)
