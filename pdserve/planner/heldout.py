"""Held-out end-to-end measurements the fitted step-time model is checked on.

None of these entered the fit (``fitted.py`` comes from Vidur's operator
profiles and, for the "vllm-2023" engine terms, from the BLOOM-176B rows of
Splitwise's file, whose Llama-2-70B rows below are held out). Each row: (gpu kind, TP, phase, tokens, batch, measured s).
For "prefill", ``tokens`` is the prompt length of one request alone (the time
to its first token); for "decode", ``tokens`` is the mean context a sequence
holds during the step and ``batch`` the sequences decoding together (the
time between tokens). Llama-2-70B in FP16/BF16 throughout.
"""

SPLITWISE = {
    "source": "github.com/Mutinifni/splitwise-sim, data/perf_model.csv at commit "
    "8f99e7dc9b407f4ce2488d03dd44c0b8b946dab0: the measured profiles of the "
    "Splitwise paper (Patel et al., ISCA 2024), vLLM on DGX-A100 and DGX-H100",
    "how": "median of the 5 runs per configuration; prompt_time of batch 1 for prefill; "
    "token_time of prompt 512 / 128 outputs (mean context 512 + 64) for decode; "
    "every other prompt length (128, 512, 2048, 8192) and batch (1, 4, 16, 64) "
    "of the published grid",
    "engine": "vLLM",
    # the host-cost terms of this engine were fitted on the same file's BLOOM-176B
    # rows (fitted.ENGINES); these Llama-2-70B rows were not read by any fit
    "engine_profile": "vllm-2023",
    "points": [
        ("a100", 2, "prefill", 128, 1, 0.0811),
        ("a100", 2, "prefill", 512, 1, 0.1969),
        ("a100", 2, "prefill", 2048, 1, 0.6881),
        ("a100", 2, "prefill", 8192, 1, 2.9902),
        ("a100", 2, "decode", 576, 1, 0.0549),
        ("a100", 2, "decode", 576, 4, 0.0605),
        ("a100", 2, "decode", 576, 16, 0.0655),
        ("a100", 2, "decode", 576, 64, 0.0672),
        ("a100", 4, "prefill", 128, 1, 0.0637),
        ("a100", 4, "prefill", 512, 1, 0.1270),
        ("a100", 4, "prefill", 2048, 1, 0.4033),
        ("a100", 4, "prefill", 8192, 1, 2.2785),
        ("a100", 4, "decode", 576, 1, 0.0450),
        ("a100", 4, "decode", 576, 4, 0.0451),
        ("a100", 4, "decode", 576, 16, 0.0485),
        ("a100", 4, "decode", 576, 64, 0.0729),
        ("a100", 8, "prefill", 128, 1, 0.0653),
        ("a100", 8, "prefill", 512, 1, 0.0943),
        ("a100", 8, "prefill", 2048, 1, 0.2742),
        ("a100", 8, "prefill", 8192, 1, 1.5498),
        ("a100", 8, "decode", 576, 1, 0.0449),
        ("a100", 8, "decode", 576, 4, 0.0458),
        ("a100", 8, "decode", 576, 16, 0.0504),
        ("a100", 8, "decode", 576, 64, 0.0716),
        ("h100", 2, "prefill", 128, 1, 0.0483),
        ("h100", 2, "prefill", 512, 1, 0.0838),
        ("h100", 2, "prefill", 2048, 1, 0.3103),
        ("h100", 2, "prefill", 8192, 1, 1.3398),
        ("h100", 2, "decode", 576, 1, 0.0370),
        ("h100", 2, "decode", 576, 4, 0.0400),
        ("h100", 2, "decode", 576, 16, 0.0420),
        ("h100", 2, "decode", 576, 64, 0.0423),
        ("h100", 4, "prefill", 128, 1, 0.0491),
        ("h100", 4, "prefill", 512, 1, 0.0596),
        ("h100", 4, "prefill", 2048, 1, 0.2007),
        ("h100", 4, "prefill", 8192, 1, 0.9536),
        ("h100", 4, "decode", 576, 1, 0.0297),
        ("h100", 4, "decode", 576, 4, 0.0299),
        ("h100", 4, "decode", 576, 16, 0.0328),
        ("h100", 4, "decode", 576, 64, 0.0524),
        ("h100", 8, "prefill", 128, 1, 0.0582),
        ("h100", 8, "prefill", 512, 1, 0.0534),
        ("h100", 8, "prefill", 2048, 1, 0.1368),
        ("h100", 8, "prefill", 8192, 1, 0.8449),
        ("h100", 8, "decode", 576, 1, 0.0298),
        ("h100", 8, "decode", 576, 4, 0.0318),
        ("h100", 8, "decode", 576, 16, 0.0342),
        ("h100", 8, "decode", 576, 64, 0.0502),
    ],
}

LMDEPLOY = {
    "source": "github.com/InternLM/lmdeploy, docs/en/benchmark/a100_fp16.md at commit "
    "3e391df4673326f79363eebe030876861a9b7090 (lmdeploy v0.1.0a1, TurboMind, "
    "A100-80G), static inference table of llama2-70b, tp 4",
    "how": "FTL(ave) at batch 1 for prefill (prompt 128 and 2048, one output token's "
    "worth of first-token latency); the 50th percentile per-token latency for "
    "decode at batch 1 (prompt 1, 128 outputs) and batch 64 (prompt 128, 2048 outputs)",
    "engine": "TurboMind",
    "engine_profile": "vidur",  # a C++ engine: no 2023-vLLM host costs
    "points": [
        ("a100", 4, "prefill", 128, 1, 0.074),
        ("a100", 4, "prefill", 2048, 1, 0.402),
        ("a100", 4, "decode", 64, 1, 0.029),
        ("a100", 4, "decode", 1152, 64, 0.043),
    ],
}

TRTLLM = {
    "source": "github.com/NVIDIA/TensorRT-LLM, docs/source/performance.md at commit "
    "138f96d45f90b9667426f7c47297d8c06bafac73, 'Low Latency' A100 (FP16) table, "
    "TensorRT-LLM v0.5, LLaMA 70B, TP 4",
    "how": "1st token latency at batch 1, input 128 and 2048",
    "engine": "TensorRT-LLM",
    "engine_profile": "vidur",
    "points": [
        ("a100", 4, "prefill", 128, 1, 0.047),
        ("a100", 4, "prefill", 2048, 1, 0.377),
    ],
}

SETS = (SPLITWISE, LMDEPLOY, TRTLLM)
