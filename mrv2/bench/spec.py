"""`mrv2 bench spec`: speculative decoding off vs each usable method, side by side.

Two workloads of chat prompts on the engine's own chat template:
- grounded: a passage (cut from `--text`, default `tools/eval_text.txt`) the answer must
  repeat word for word, the case n-gram speculation exists for;
- open: open-ended requests (stories, explanations) with nothing to copy.
Each runs at every `--batch-sizes` size (batch 1: four prompts one after another;
batch B: B prompts at once), greedy, `--output-len` tokens (`ignore_eos`). Every engine
runs in a spawned process of its own; they take turns `--repeat` times and the medians,
pair-by-pair ratios of output tok/s, acceptance rates and mean accepted lengths, and
how many greedy outputs equal the run without speculation are reported.

Model-based methods take `--draft-model`; without one, "draft_model" drafts with a copy
of the target cut to its first `--draft-layers` layers (no small model shares the
default model's tokenizer here), which shows the method's cost and acceptance, not a
trained drafter's. Eagle / Eagle-3 need a trained head (`--draft-model`); "mtp" needs a
checkpoint with MTP layers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from mrv2.config import SpeculativeConfig

OPEN_TASKS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
              "Describe a busy market on a summer morning.", "Give advice to someone learning to cook.",
              "Write a letter to a friend about a trip to the mountains.", "Explain why the sky is blue.",
              "Describe your ideal weekend.", "Write a poem about autumn leaves."]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram", help="comma-separated methods to compare with no speculation")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="the drafter of draft_model / eagle / eagle3")
    p.add_argument("--draft-layers", type=int, default=6,
                   help="without --draft-model, draft_model drafts with the target's first N layers")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--passage-len", type=int, default=120, help="tokens of text in a grounded prompt")
    p.add_argument("--text", default=None, help="text to cut passages from (default: tools/eval_text.txt)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine, taken in turns")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def _default_text() -> str:
    path = Path(__file__).resolve().parents[2] / "tools" / "eval_text.txt"
    if not path.exists():
        raise ValueError(f"no --text given and {path} is missing")
    return path.read_text()


def workloads(tokenizer, text: str, passage_len: int, count: int) -> dict[str, list[list[int]]]:
    """Chat-templated token ids: `count` grounded prompts (passages at even offsets, wrapping) and `count` open ones."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < passage_len:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --passage-len {passage_len}")
    step = max(1, (len(ids) - passage_len) // max(count - 1, 1))
    passages = [tokenizer.decode(ids[(i * step) % (len(ids) - passage_len + 1):][:passage_len]) for i in range(count)]

    def chat(content: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    grounded = [chat(f"Here is a passage:\n\n{p}\n\nRepeat the passage above word for word.") for p in passages]
    open_ended = [chat(OPEN_TASKS[i % len(OPEN_TASKS)]) for i in range(count)]
    return {"grounded": grounded, "open": open_ended}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from mrv2 import SamplingParams
    from mrv2.bench.engines import IsolatedEngine
    from mrv2.engine.arg_utils import engine_kwargs

    methods = [m for m in args.methods.split(",") if m]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not methods or min(sizes) < 1 or min(args.output_len, args.repeat, args.passage_len) < 1:
        raise ValueError("--methods must name one method; --batch-sizes, --output-len, --repeat and "
                         "--passage-len must be positive")
    text = Path(args.text).read_text() if args.text else _default_text()
    kwargs = engine_kwargs(args) | {"speculative_config": None}
    scratch = tempfile.TemporaryDirectory(prefix="mrv2-bench-spec-")
    configs = {"off": kwargs} | {m: kwargs | {"speculative_config": _speculative_config(m, args, kwargs, scratch.name)}
                                 for m in methods}
    engines = {}
    try:
        for name, kw in configs.items():
            engines[name] = IsolatedEngine(kw)
        info = engines["off"].info
        tokenizer = AutoTokenizer.from_pretrained(info.model_path)
        prompts = workloads(tokenizer, text, args.passage_len, max(max(sizes), 4))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for engine in engines.values():  # warm-up
            engine.timed_generate(prompts["grounded"][:2], SamplingParams(temperature=0.0, max_tokens=4))
        results: dict = {}
        for wname, pool in prompts.items():
            for b in sizes:
                batches = [[p] for p in pool[:4]] if b == 1 else [pool[:b]]
                runs: dict[str, list] = {name: [] for name in engines}
                for _ in range(args.repeat):
                    for name, engine in engines.items():
                        runs[name].append([engine.timed_generate(batch, params) for batch in batches])
                results[f"{wname} b{b}"] = _summarize(runs)
    finally:
        for engine in engines.values():
            engine.close()
        scratch.cleanup()
    print(f"{args.output_len} output tokens per request, greedy, {info.dtype}, {info.threads} threads, "
          f"k = {args.num_speculative_tokens}, median of {args.repeat} (batch 1: 4 prompts in turn)")
    print(f"{'workload':14s} {'engine':11s} {'tok/s':>8s} {'vs off':>7s}  {'pairs':18s} {'accept':>6s} "
          f"{'mean len':>8s}  identical")
    for key, r in results.items():
        for name, m in r.items():
            ratio = "" if name == "off" else f"{m['ratio_median']:6.2f}x"
            pairs = "" if name == "off" else ", ".join(f"{p:.2f}" for p in m["ratio_pairs"])
            accept = "" if m["acceptance_rate"] is None else f"{100 * m['acceptance_rate']:5.1f}%"
            length = "" if m["mean_acceptance_length"] is None else f"{m['mean_acceptance_length']:8.2f}"
            print(f"{key:14s} {name:11s} {m['tok_s_median']:8.1f} {ratio:>7s}  {pairs:18s} {accept:>6s} "
                  f"{length:>8s}  {m['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": {"dtype": info.dtype, "output_len": args.output_len, "repeat": args.repeat,
                                 "num_speculative_tokens": args.num_speculative_tokens}, "results": results},
                      f, indent=2)
    return 0


def _speculative_config(method: str, args: argparse.Namespace, kwargs: dict, scratch: str) -> dict:
    config = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if method in SpeculativeConfig.NEEDS_MODEL_PATH:
        if args.draft_model is not None:
            config["model"] = args.draft_model
        elif method == "draft_model":
            from mrv2.loader.resolve import resolve_model_path

            config["model"] = str(truncated_copy(resolve_model_path(kwargs.get("model")), args.draft_layers,
                                                 Path(scratch) / "draft"))
        else:
            raise ValueError(f"--methods {method} needs --draft-model (a trained {method} head)")
    return config


def truncated_copy(source: Path, num_layers: int, dest: Path) -> Path:
    """A checkpoint of `source`'s first `num_layers` decoder layers (embedding, norm, LM head and tokenizer kept)."""
    from safetensors.torch import save_file

    from mrv2.loader.safetensors_weights import iter_safetensors_weights

    config = json.loads((source / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    dest.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, dest / name)
    keep = {n: t.contiguous() for n, t in iter_safetensors_weights(source)
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers}
    save_file(keep, str(dest / "model.safetensors"))
    return dest


def _summarize(runs: dict[str, list]) -> dict:
    """Per engine: tok/s per repeat, ratio pairs against "off", acceptance, identical greedy outputs."""
    def tok_s(timed: list) -> float:
        return sum(len(t) for r in timed for t in r.token_ids) / sum(r.seconds for r in timed)

    def tokens(timed: list) -> list:
        return [t for r in timed for t in r.token_ids]

    off = [tok_s(t) for t in runs["off"]]
    reference = tokens(runs["off"][0])
    out = {}
    for name, repeats in runs.items():
        speeds = [tok_s(t) for t in repeats]
        pairs = [a / b for a, b in zip(speeds, off)]
        drafts = sum(r.spec.num_drafts for t in repeats for r in t) if repeats[0][0].spec else 0
        proposed = sum(r.spec.num_draft_tokens for t in repeats for r in t) if drafts else 0
        accepted = sum(r.spec.num_accepted_tokens for t in repeats for r in t) if drafts else 0
        same = sum(a == b for a, b in zip(tokens(repeats[0]), reference))
        out[name] = {"tok_s": speeds, "tok_s_median": statistics.median(speeds), "ratio_pairs": pairs,
                     "ratio_median": statistics.median(pairs),
                     "acceptance_rate": accepted / proposed if proposed else None,
                     "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                     "identical": f"{same}/{len(reference)}"}
    return out
