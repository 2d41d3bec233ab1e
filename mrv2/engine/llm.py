"""`LLM`: the offline batch API, with vLLM's names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from mrv2.config import (CacheConfig, EngineConfig, GraphConfig, GraphMode, KVTransferConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, SpeculativeConfig)
from mrv2.engine.llm_engine import LLMEngine
from mrv2.engine.outputs import RequestOutput
from mrv2.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | dict[str, Any]


def _graph_mode(name: str | None, compile: bool | None) -> GraphMode:
    if name is None:  # other graph options given without a mode: compiling alone means compiled pieces
        return GraphMode.PIECEWISE if compile else GraphMode.FULL
    try:
        return GraphMode(name.lower())
    except ValueError:
        raise ValueError(f"graph_mode must be one of {[m.value for m in GraphMode]}, got {name!r}") from None
Message = dict[str, Any]


def engine_config(model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                  max_model_len: int | None = None, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                  kv_cache_memory: int | None = None, kv_cache_memory_fraction: float = 0.5,
                  block_size: int = 16, kv_cache_layout: str = "joint", kv_transfer: bool = False,
                  enable_chunked_prefill: bool = True, enforce_eager: bool = False, seed: int = 0,
                  device: str | None = None, graph_mode: str | None = None,
                  graph_capture_sizes: Sequence[int] | None = None, graph_compile: bool | None = None,
                  async_scheduling: bool | None = None, quantization: str | None = "auto",
                  int8_activations: bool = True, enable_prefix_caching: bool = True, batch_invariant: bool = False,
                  speculative_config: dict[str, Any] | None = None, tensor_parallel_size: int = 1,
                  distributed_executor_backend: str | None = None,
                  kv_transfer_config: dict[str, Any] | None = None,
                  structured_outputs_backend: str = "xgrammar",
                  attention_backend: str | None = None) -> EngineConfig:
    """The EngineConfig for `LLM(...)` / `AsyncLLM(...)` keyword arguments (see `LLM`)."""
    kv_transfer_config = KVTransferConfig.from_dict(kv_transfer_config)
    kv_transfer = kv_transfer or kv_transfer_config is not None  # a connector registers the aligned cache
    return EngineConfig(
        model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, seed=seed,
                          quantization=quantization, int8_activations=int8_activations,
                          batch_invariant=batch_invariant,
                          attention_backend=attention_backend),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                          memory_fraction=kv_cache_memory_fraction, layout=kv_cache_layout,
                          kv_transfer=kv_transfer, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=enable_chunked_prefill),
        graph=None if (graph_mode, graph_capture_sizes, graph_compile) == (None, None, None) else GraphConfig(
            mode=_graph_mode(graph_mode, graph_compile),
            capture_sizes=tuple(graph_capture_sizes) if graph_capture_sizes is not None else None,
            compile=graph_compile),
        enforce_eager=enforce_eager, device=device, async_scheduling=async_scheduling,
        speculative=SpeculativeConfig.from_dict(speculative_config),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                distributed_executor_backend=distributed_executor_backend),
        kv_transfer=kv_transfer_config, structured_outputs_backend=structured_outputs_backend,
    )


class LLM:
    """Generate completions for batches of prompts.

    `model` is an HF checkpoint folder or a GGUF file; None runs the embedded
    SmolLM2-135M-Instruct. The KV cache takes `kv_cache_memory` bytes when given,
    else `kv_cache_memory_fraction` of the free device memory. `graph_mode` ("none";
    "full": whole uniform-decode steps; "piecewise": the layers between attention calls,
    any step; "full_and_piecewise": full where it fits, else piecewise; default: the
    platform's, full on CUDA/NPU; on the CPU a compiled full graph for a decode of one request
    where attention allows it, and compiled pieces where small steps run on quantized kernels) and
    `graph_capture_sizes` (requests for full, tokens for piecewise) set graph capture;
    `graph_compile` runs the graphs through torch.compile on the CPU (default: pieces
    compiled, full graphs re-run eagerly); `enforce_eager` turns it all off.
    `async_scheduling` overlaps the host's scheduling and input preparation of the next
    step with the current step's compute
    (default: the platform's; see `mrv2 bench throughput`). `quantization` ("auto",
    "gguf" or None) keeps a GGUF file's quantized tensors quantized or dequantizes them
    (see `ModelConfig`); `int8_activations=False` keeps the activations of kept-quantized weights' batch
    kernels in bf16 (default: int8 per block where that is faster, as llama.cpp).
    `enable_prefix_caching` lets requests reuse the KV blocks of a
    prefix another request computed (vLLM's automatic prefix caching).
    `batch_invariant` makes each request's logprobs bitwise identical whatever batch,
    chunking or cache state it runs in, slower (see `ModelConfig`). `attention_backend`
    names the attention backend instead of the platform's choice (for GQA on the CPU: "cpp-paged",
    decode attention through mrv2's C++ kernel reading KV blocks in place, the default; "inductor-paged",
    the same compiled by Inductor; "torch", gathering the blocks).
    `speculative_config` ({"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 1, "prompt_lookup_max": 4}) verifies up to k drafted tokens per
    request and step in one forward; outputs equal those without it (see `SpeculativeConfig`).
    `tensor_parallel_size` spreads every layer over that many ranks (processes here, one per
    core share on the CPU; `distributed_executor_backend` "mp", the default, or "ray").
    `kv_transfer_config` ({"kv_connector": "ShmConnector", "kv_role": "kv_producer" |
    "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}) makes this engine one
    side of prefill/decode disaggregation (see `SamplingParams.kv_transfer_params`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (nothing done) while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; results come back in input order.

        Every prompt and parameter set is validated before any request starts, so a
        bad input raises ValueError and leaves the engine idle and ready.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        # Only final outputs are returned: the engine builds no per-step ones.
        sampling_params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(sp, SamplingParams)
                           else sp for sp in sampling_params]
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        return self._run(requests, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order = {r.req_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        try:
            for r in requests:
                engine.add_request(r)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # Blocks return at once; the runner frees the slots at the next step.
            engine.abort([r.req_id for r in requests])
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]
