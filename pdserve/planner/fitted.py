"""Fitted constants of the step-time model (``perf.py``), with their provenance.

Data, not code: every number below was produced by
``python -m pdserve.planner.fit_profiles --vidur-git <clone of microsoft/vidur>
--splitwise-git <clone of Mutinifni/splitwise-sim>`` from the sources named in
``SOURCES`` (``FITS``: Vidur's operator profiles; ``ENGINES``: Splitwise's
BLOOM-176B runs). Times are seconds,
rates bytes/s, efficiencies shares of the datasheet peak in ``hardware.py``.
"""

SOURCES = {
    "vidur": {
        "repo": "github.com/microsoft/vidur",
        "commit": "7d47513363ec447a741ac5e47241580b47724fbf",
        "attention_commit": "e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a",
        "cpu_commit": "6d98aa8f71696520acc603d87439e77cc78160a7",
        "models": {
            "a100": [
                "meta-llama/Llama-2-7b-hf",
                "meta-llama/Llama-2-70b-hf",
                "meta-llama/Meta-Llama-3-8B",
                "meta-llama/Meta-Llama-3-70B",
                "codellama/CodeLlama-34b-Instruct-hf",
            ],
            "h100": ["meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf", "codellama/CodeLlama-34b-Instruct-hf"],
        },
    },
    # End-to-end runs of another model on the engine and nodes of the held-out
    # Splitwise set; only the BLOOM-176B rows are read (Llama-2-70B's are held out).
    "flash_attention_share": {
        "a100": "0.73: Dao, FlashAttention-2, arXiv 2307.08691 (2023), abstract: '50-73% of the theoretical maximum FLOPs/s on A100'",
        "h100": "0.35: Shah et al., FlashAttention-3, arXiv 2407.08608 (2024), abstract: 'FlashAttention-2 achieving only 35% utilization on the H100 GPU'",
    },
    "splitwise_bloom": {
        "repo": "github.com/Mutinifni/splitwise-sim",
        "commit": "8f99e7dc9b407f4ce2488d03dd44c0b8b946dab0",
        "path": "data/perf_model.csv",
        "rows": "model bloom-176b, hardware a100-80gb and h100-80gb, tensor_parallel 8",
    },
}

# What each term was fitted on (see docs/planner.md for the method and the errors).
# - gemm: the q/k/v, o, gate/up and down projections of the models above, every
#   profiled token count (1..4,096+) and TP size (1, 2, 4, 8); median kernel times.
# - elementwise: the same rows' RMSNorms, RoPE, SwiGLU and residual adds.
# - allreduce: `network/{a100,h100}_dgx/all_reduce.csv`, TP groups inside one node,
#   messages up to 64 MiB.
# - attention: Vidur published attention kernels for A100 only (Llama-2-70B shape,
#   TP 2, FlashAttention prefill and paged decode, file `data/profiling/a100/attention.csv`
#   at `attention_commit`). Prefill: a launch, a per-query-token-per-head term, and
#   two shares of peak, one for the pairs among a chunk's new tokens (causal) and
#   one for its pairs against cached tokens (RMS error 7.8% on the 4,418 rows; one
#   share for both had 22.8% and priced prompts without a cache up to 44% low). H100
#   takes A100's shares x 0.35 / 0.73, FlashAttention-2's best share of peak on
#   H100 over A100 (FA3 paper, arXiv 2407.08608, and FA2 paper, arXiv 2307.08691,
#   abstracts: that kernel generation uses no Hopper TMA / warp-group MMA); decode
#   (bandwidth-bound) keeps A100's share. Vidur's H100 attention CSVs at `commit`
#   are Git LFS objects (10 MB) and were not available.
# - cpu: `data/profiling/a100/cpu_overheads.csv` at `cpu_commit` (vLLM with Ray
#   workers: schedule + sampler + prepare inputs + process outputs + Ray hop), by
#   TP 1, 2, 4; TP 8 extrapolates TP 2 -> 4 linearly. CPU work does not depend on the GPU, so H100
#   shares it.
FITS = {
    "a100": {
        "gemm": {"compute_eff": 0.70, "bandwidth_eff": 0.77, "launch_s": 6.6e-06, "rms_rel_err": 0.106, "rows": 27120},
        "elementwise": {"fixed_s": 1.24e-05, "bytes_per_token_hidden": 24.26},
        "allreduce": {
            2: {"latency_s": 3.58e-05, "bytes_per_s": 158.4e9},
            4: {"latency_s": 2.87e-05, "bytes_per_s": 102.6e9},
            8: {"latency_s": 3.90e-05, "bytes_per_s": 86.8e9},
        },
        "attention": {
            "prefill": {"fixed_s": 1.45e-05, "per_token_head_s": 2.11e-09, "causal_eff": 0.219, "cached_eff": 0.463},
            "decode": {"fixed_s": 1.34e-05, "eff": 0.766},
        },
        "cpu": {
            1: {"fixed_s": 0.000968, "per_seq_s": 4.87e-05},
            2: {"fixed_s": 0.007677, "per_seq_s": 4.43e-05},
            4: {"fixed_s": 0.008484, "per_seq_s": 3.49e-05},
        },
    },
    "h100": {
        "gemm": {"compute_eff": 0.67, "bandwidth_eff": 0.85, "launch_s": 6.8e-06, "rms_rel_err": 0.146, "rows": 12528},
        "elementwise": {"fixed_s": 1.22e-05, "bytes_per_token_hidden": 21.17},
        "allreduce": {
            2: {"latency_s": 1.66e-05, "bytes_per_s": 282.1e9},
            4: {"latency_s": 3.06e-05, "bytes_per_s": 253.0e9},
            8: {"latency_s": 2.86e-05, "bytes_per_s": 193.7e9},
        },
        "attention": {
            "prefill": {"fixed_s": 1.45e-05, "per_token_head_s": 2.11e-09, "causal_eff": 0.105, "cached_eff": 0.222},
            "decode": {"fixed_s": 1.34e-05, "eff": 0.766},
        },
        "cpu": {
            1: {"fixed_s": 0.000968, "per_seq_s": 4.87e-05},
            2: {"fixed_s": 0.007677, "per_seq_s": 4.43e-05},
            4: {"fixed_s": 0.008484, "per_seq_s": 3.49e-05},
        },
    },
}

# Catalog GPUs and the profiled kind whose constants they use. H800 and H200
# are H100 silicon (different NVLink, HBM); their own peaks enter the formulas.
GPU_KIND = {"a100-80gb": "a100", "a100-40gb": "a100", "h100-sxm": "h100", "h800": "h100", "h200": "h100"}
# This machine's CPU stands in for a GPU in tests: no GPU profile describes it.
NO_FIT = ("cpu-local",)
# Other accelerators have no profile: A100's shares of peak, on their own peaks.
DEFAULT_KIND = "a100"
# NVLink bytes/s (both directions, as in hardware.py) of the profiled DGX nodes:
# another chip's all-reduce bandwidth scales by its fabric over this one.
FABRIC_BYTES_PER_S = {"a100": 600e9, "h100": 900e9}

# Host-side costs an engine adds to the operator-level step above (perf._engine_s).
# "vidur": nothing beyond the CPU terms in FITS. "vllm-2023": the vLLM that
# Splitwise measured (Patel et al., ISCA 2024; eager PyTorch, Ray workers),
# fitted by ``fit_profiles --splitwise-git`` on its BLOOM-176B rows (TP 8):
# the measured decode step minus the operator model's, over batches 1-64,
# as ``fixed + per_seq x batch``; ``prefill_fixed_s`` is the further cost of a
# step that prefills (prompts of 128-1,024 tokens). Only runs of 128 outputs
# whose end-to-end time is their prompt time plus 127 token times (within 10%,
# ``validate.consistent_run``) are read; every BLOOM run of that grid passes.
# The host CPU differs by
# node (DGX-A100: AMD EPYC 7742; DGX-H100: Intel Xeon 8480C), hence per kind.
# Only TP 8 was measured: other TP sizes take the same terms (an assumption),
# and batches beyond ``max_batch_fitted`` extrapolate the line.
# "vllm-2023-overlap": the same runs read the other way physics allows. That
# engine issues kernels from Python while the GPU runs those already issued, so
# the issue window (``launch_per_layer_s`` x layers) overlaps GPU time:
# ``step = CPU terms + per_seq x batch + prefill_fixed + max(GPU, window)``.
# The BLOOM runs fit both readings alike (3.8% and 3.3% RMS): the window is
# pinned only because BLOOM's GPU time (37 ms / 23 ms at batch 1) sits at it.
ENGINES = {
    "vidur": {},
    "vllm-2023": {
        "a100": {"fixed_s": -0.00027, "per_seq_s": 0.000447, "prefill_fixed_s": 0.0168, "max_batch_fitted": 64},
        "h100": {"fixed_s": 0.00184, "per_seq_s": 0.000244, "prefill_fixed_s": 0.0075, "max_batch_fitted": 64},
    },
    "vllm-2023-overlap": {
        "a100": {
            "per_seq_s": 0.000406,
            "prefill_fixed_s": 0.0166,
            "launch_per_layer_s": 0.000554,
            "max_batch_fitted": 64,
        },
        "h100": {
            "per_seq_s": 0.00027,
            "prefill_fixed_s": 0.0093,
            "launch_per_layer_s": 0.000371,
            "max_batch_fitted": 64,
        },
    },
}
