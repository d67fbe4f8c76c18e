"""PagedLLM engine, models, sampler, HTTP API and CLI.

``from pagedllm.server import LLM, SamplingParams`` is the offline API.
"""

from pagedllm.server.llm import LLM
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
