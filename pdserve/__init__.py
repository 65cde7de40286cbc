"""pdserve: LLM serving built around prefill/decode disaggregation.

`from pdserve import LLM, SamplingParams` loads lazily, so that the planner and
the simulator import without torch.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "Logprob", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "LoRARequest":
        from pdserve.engine.lora import LoRARequest

        return LoRARequest
    if name == "Logprob":
        from pdserve.engine.sequence import Logprob

        return Logprob
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from pdserve.engine.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
