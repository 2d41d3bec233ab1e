"""The `mrv2` command: generate, chat, serve, bench, eval."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

from mrv2.engine.arg_utils import add_engine_args, engine_kwargs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeat for several)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def sampling_params(args: argparse.Namespace, seed: int | None):
    from mrv2.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=seed, min_tokens=args.min_tokens, stop=args.stop,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)


def _read_inputs(path: str) -> list[Any]:
    """One prompt per line: plain text, or JSON with "prompt", "prompt_token_ids" or "messages"."""
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
                if not any(k in obj for k in ("prompt", "prompt_token_ids", "messages")):
                    raise ValueError(f"{path}:{n}: a JSON line needs 'prompt', 'prompt_token_ids' or 'messages'")
                items.append(obj)
            else:
                items.append(line)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def cmd_generate(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.sampling_params import is_greedy

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give a prompt or --input FILE (exactly one)")
    params = sampling_params(args, args.seed if not is_greedy(args.temperature) else None)
    items = _read_inputs(args.input) if args.input is not None else None  # a bad file fails before the model loads
    llm = LLM(**engine_kwargs(args))
    if items is None:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
        print(out.outputs[0].text)
        return 0
    tokenizer = llm.get_tokenizer()
    prompts = []
    for item in items:
        messages = item.get("messages") if isinstance(item, dict) else None
        if messages is None and args.chat:
            text = item if isinstance(item, str) else item.get("prompt")
            messages = [{"role": "user", "content": text}] if text is not None else None
        if messages is not None:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
            prompts.append({"prompt_token_ids": list(ids)})
        else:
            prompts.append(item)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for item, out in zip(items, outputs):
            c = out.outputs[0]
            record = {"prompt": item if isinstance(item, str) else item.get("prompt", item.get("messages")),
                      "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from mrv2 import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args, None)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("mrv2 chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = llm.chat(history, params)[0].outputs[0].text
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
        print(reply)


def cmd_serve(args: argparse.Namespace) -> int:
    from mrv2.entrypoints.openai.api_server import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mrv2", description="Model Runner V2 LLM engine")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, or every prompt of a file")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--input", default=None, help="a file with one prompt a line (text or JSONL)")
    gen.add_argument("--output", default=None, help="where to write JSONL results (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat session")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    from mrv2.entrypoints.openai.args import add_server_args

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_server_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    from mrv2.entrypoints.proxy import add_proxy_args, run_proxy

    prx = sub.add_parser("proxy", help="prefill/decode disaggregation: each request to a prefill, then a decode instance")
    add_proxy_args(prx)
    prx.set_defaults(func=run_proxy)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    benches = (("throughput", "offline throughput: N prompts x M output tokens"),
               ("serve", "load an OpenAI-compatible server: throughput, TTFT/TPOT/ITL per load"),
               ("prefix", "a shared-prefix workload with prefix caching on and off"),
               ("latency", "time to first token and per output token, one request at a time"),
               ("decode", "decode step time, eager vs the graph path, at several batch sizes"),
               ("soak", "many short requests with random aborts: resident memory and KV blocks, start vs end"),
               ("spec", "speculative decoding off vs each method, on grounded and open-ended prompts"))
    for name, text in benches:
        module = importlib.import_module(f"mrv2.bench.{name}")
        bp = bench_sub.add_parser(name, help=text)
        module.add_args(bp)
        add_engine_args(bp)
        bp.set_defaults(func=module.run)

    from mrv2.bench.mla import add_args as add_mla_args, run as run_mla

    mla = bench_sub.add_parser("mla", help="MLA KV bytes per token and decode step time, absorbed vs up-projected")
    add_mla_args(mla)
    mla.add_argument("--device", default=None)
    mla.set_defaults(func=run_mla)
    ev = sub.add_parser("eval", help="quality measurements")
    ev_sub = ev.add_subparsers(dest="eval", required=True)
    ppl = ev_sub.add_parser("perplexity", help="perplexity of the model on a text file (sliding window)")
    ppl.add_argument("--file", required=True, help="a UTF-8 text file")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per forward (capped at max_model_len)")
    ppl.add_argument("--stride", type=int, default=None, help="tokens the window advances (default: half of it)")
    ppl.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)
    agr = ev_sub.add_parser("agreement", help="greedy agreement with the same model in float32 on prompts from a text")
    agr.add_argument("--file", required=True, help="a UTF-8 text file; prompts are windows of its tokens")
    agr.add_argument("--num-prompts", type=int, default=16)
    agr.add_argument("--prompt-len", type=int, default=24)
    agr.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    agr.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_args(agr)
    agr.set_defaults(func=cmd_agreement)
    return parser


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--file {path}: {e.strerror}") from None


def cmd_perplexity(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.eval import perplexity

    text = _read_text(args.file)
    llm = LLM(**engine_kwargs(args))
    result = perplexity(llm, text, args.window, args.stride)
    record = {"file": args.file, "dtype": str(llm.engine.dtype).removeprefix("torch."), "tokens": result.num_tokens,
              "nll": result.nll, "perplexity": result.perplexity}
    print(f"{args.file}: {result.num_tokens} tokens scored, {record['dtype']}, nll {result.nll:.4f} nats/token, "
          f"perplexity {result.perplexity:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def cmd_agreement(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.eval import greedy_agreement

    text = _read_text(args.file)
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    reference = LLM(**kwargs | {"dtype": "float32", "quantization": None})
    r = greedy_agreement(llm, reference, text, args.num_prompts, args.prompt_len, args.max_tokens)
    quantization = llm.engine.config.model.quantization or "none"
    record = {"file": args.file, "dtype": str(llm.engine.dtype).removeprefix("torch."), "quantization": quantization,
              "reference": "float32, quantization none", "prompts": r.num_prompts, "max_tokens": r.max_tokens,
              "identical": r.identical, "prefix_share": r.prefix_share}
    print(f"{args.file}: {record['dtype']} (quantization {quantization}) against float32 (quantization none), "
          f"{r.num_prompts} prompts x {r.max_tokens} greedy tokens: identical completions {r.identical}/"
          f"{r.num_prompts} ({100 * r.identical_share:.0f}%), mean share before the first difference "
          f"{100 * r.prefix_share:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"mrv2: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
