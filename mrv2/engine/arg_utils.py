"""Engine options on the command line, shared by the CLI and the benchmarks.

`add_engine_args` declares them on a parser, `engine_kwargs` turns the parsed
namespace into `LLM(...)` keyword arguments. They live here, not in the CLI, so
that `mrv2.bench` never imports `mrv2.entrypoints`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options, as one argument group of `p`."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--device", default=None, help="cpu, cuda or npu (default: best available)")
    g.add_argument("--enforce-eager", action="store_true", help="no graph capture")
    g.add_argument("--graph-mode", choices=["none", "piecewise", "full", "full_and_piecewise"], default=None,
                   help="full: whole decode steps; piecewise: layers between attention calls, any step; "
                        "full_and_piecewise: full where it fits, else piecewise "
                        "(default: the platform's: full on CUDA/NPU; on the CPU a compiled full graph for a decode "
                        "of one request where attention allows it, and compiled pieces where small steps run on "
                        "quantized kernels)")
    g.add_argument("--graph-capture-sizes", default=None,
                   help="comma-separated sizes to capture (requests for full, tokens for piecewise)")
    g.add_argument("--graph-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the graphs on the CPU (default: pieces compiled, full graphs not)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling of the next step with the current one (default: the platform's)")
    g.add_argument("--quantization", choices=["auto", "gguf", "none"], default="auto",
                   help="a GGUF file's quantized tensors: auto: int4 kernels where fast (+ a dense copy for large "
                        "batches when it fits), gguf: int4 only, none: dequantize")
    g.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="let the quantized weights' kernels for batches quantize activations to int8 per block "
                        "where faster, as llama.cpp does (default: on; --no-int8-activations keeps bf16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prefixes shared between requests (default: on)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="bitwise-identical logprobs for a request whatever batch it runs in (slower)")
    g.add_argument("--attention-backend", default=None,
                   help="an attention backend by name instead of the platform's choice "
                        "(CPU: cpp-paged, the default, inductor-paged or torch)")
    g.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks every layer is split over (one process each; on the CPU each gets a share of the cores)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                   help="how ranks run: mp (worker processes, the default) or ray (actors on a Ray cluster)")
    g.add_argument("--kv-transfer-config", type=_json_dict, default=None,
                   help='prefill/decode disaggregation as JSON, e.g. \'{"kv_connector": "ShmConnector", '
                        '"kv_role": "kv_producer"}\' (roles: kv_producer, kv_consumer, kv_both)')
    g.add_argument("--structured-outputs-backend", choices=["xgrammar"], default="xgrammar",
                   help="compiles structured outputs' grammars (JSON schema, regex, choice, EBNF)")
    g.add_argument("--seed", type=int, default=0)


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--graph-capture-sizes must be comma-separated integers, got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from options parsed with `add_engine_args`."""
    return dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, device=args.device, enforce_eager=args.enforce_eager,
                graph_mode=args.graph_mode, graph_capture_sizes=_sizes(args.graph_capture_sizes),
                graph_compile=args.graph_compile, async_scheduling=args.async_scheduling, seed=args.seed,
                quantization=args.quantization, int8_activations=args.int8_activations,
                enable_prefix_caching=args.enable_prefix_caching,
                batch_invariant=args.batch_invariant, speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend,
                kv_transfer_config=args.kv_transfer_config, structured_outputs_backend=args.structured_outputs_backend,
                attention_backend=args.attention_backend)
