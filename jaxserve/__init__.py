"""jaxserve: an LLM inference server on JAX/XLA with Pallas paged attention."""

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.lora.request import LoRARequest
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in JAX and the model; import it only when asked for.
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
