"""mrv2: a Model Runner V2 LLM execution engine for CPU, CUDA and Ascend NPU."""

from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from mrv2.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'mrv2' has no attribute {name!r}")
