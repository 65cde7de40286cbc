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
    # (prompt_time, token_time, e2e_time) in seconds of each point's run (prompt 512 for the
    # decode points), medians of its 5 runs, 128 outputs: validate.consistent_run checks that
    # e2e = prompt + 127 x token, i.e. that the run was one steady batch
    "outputs": 128,
    "runs": {
        ("a100", 2, "prefill", 128, 1): (0.0811, 0.0537, 6.90),
        ("a100", 2, "prefill", 512, 1): (0.1969, 0.0549, 7.17),
        ("a100", 2, "prefill", 2048, 1): (0.6881, 0.0549, 7.66),
        ("a100", 2, "prefill", 8192, 1): (2.9902, 0.0573, 10.32),
        ("a100", 2, "decode", 576, 1): (0.1969, 0.0549, 7.17),
        ("a100", 2, "decode", 576, 4): (0.8454, 0.0605, 8.54),
        ("a100", 2, "decode", 576, 16): (3.2388, 0.0655, 11.58),
        ("a100", 2, "decode", 576, 64): (0.7942, 0.0672, 159.63),
        ("a100", 4, "prefill", 128, 1): (0.0637, 0.0424, 5.45),
        ("a100", 4, "prefill", 512, 1): (0.1270, 0.0450, 5.84),
        ("a100", 4, "prefill", 2048, 1): (0.4033, 0.0450, 6.12),
        ("a100", 4, "prefill", 8192, 1): (2.2785, 0.0461, 8.11),
        ("a100", 4, "decode", 576, 1): (0.1270, 0.0450, 5.84),
        ("a100", 4, "decode", 576, 4): (0.5714, 0.0451, 6.30),
        ("a100", 4, "decode", 576, 16): (2.8926, 0.0485, 9.04),
        ("a100", 4, "decode", 576, 64): (10.9478, 0.0729, 20.22),
        ("a100", 8, "prefill", 128, 1): (0.0653, 0.0430, 5.53),
        ("a100", 8, "prefill", 512, 1): (0.0943, 0.0449, 5.80),
        ("a100", 8, "prefill", 2048, 1): (0.2742, 0.0454, 6.05),
        ("a100", 8, "prefill", 8192, 1): (1.5498, 0.0465, 7.49),
        ("a100", 8, "decode", 576, 1): (0.0943, 0.0449, 5.80),
        ("a100", 8, "decode", 576, 4): (0.2923, 0.0458, 6.11),
        ("a100", 8, "decode", 576, 16): (2.0844, 0.0504, 8.48),
        ("a100", 8, "decode", 576, 64): (7.5540, 0.0716, 16.50),
        ("h100", 2, "prefill", 128, 1): (0.0483, 0.0372, 4.78),
        ("h100", 2, "prefill", 512, 1): (0.0838, 0.0370, 4.79),
        ("h100", 2, "prefill", 2048, 1): (0.3103, 0.0374, 5.06),
        ("h100", 2, "prefill", 8192, 1): (1.3398, 0.0378, 6.18),
        ("h100", 2, "decode", 576, 1): (0.0838, 0.0370, 4.79),
        ("h100", 2, "decode", 576, 4): (0.2998, 0.0400, 5.38),
        ("h100", 2, "decode", 576, 16): (1.1920, 0.0420, 6.53),
        ("h100", 2, "decode", 576, 64): (0.3606, 0.0423, 83.89),
        ("h100", 4, "prefill", 128, 1): (0.0491, 0.0284, 3.65),
        ("h100", 4, "prefill", 512, 1): (0.0596, 0.0297, 3.84),
        ("h100", 4, "prefill", 2048, 1): (0.2007, 0.0298, 3.99),
        ("h100", 4, "prefill", 8192, 1): (0.9536, 0.0297, 4.77),
        ("h100", 4, "decode", 576, 1): (0.0596, 0.0297, 3.84),
        ("h100", 4, "decode", 576, 4): (0.1953, 0.0299, 4.00),
        ("h100", 4, "decode", 576, 16): (0.8743, 0.0328, 5.08),
        ("h100", 4, "decode", 576, 64): (3.5205, 0.0524, 10.18),
        ("h100", 8, "prefill", 128, 1): (0.0582, 0.0299, 3.86),
        ("h100", 8, "prefill", 512, 1): (0.0534, 0.0298, 3.84),
        ("h100", 8, "prefill", 2048, 1): (0.1368, 0.0310, 4.09),
        ("h100", 8, "prefill", 8192, 1): (0.8449, 0.0314, 4.87),
        ("h100", 8, "decode", 576, 1): (0.0534, 0.0298, 3.84),
        ("h100", 8, "decode", 576, 4): (0.1326, 0.0318, 4.17),
        ("h100", 8, "decode", 576, 16): (0.8119, 0.0342, 5.14),
        ("h100", 8, "decode", 576, 64): (2.9363, 0.0502, 9.34),
    },
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
