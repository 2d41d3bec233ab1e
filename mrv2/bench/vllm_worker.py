"""vLLM's side of `mrv2 bench throughput --compare vllm`, run by the interpreter of vLLM's own environment.

vLLM's CPU build pins its own torch, so it does not share mrv2's environment: this file is run
as a script by that environment's python and imports nothing from mrv2. It loads the model
once, prints a ready line, then times one greedy `generate` per request line on stdin
(JSON: token-id prompts and output length), answering with the wall seconds and output ids.
Protocol lines start with `PREFIX`; vLLM's own logging goes elsewhere on the same streams.
"""

import json
import sys
import time

PREFIX = "MRV2-PEER "


def main() -> None:
    from vllm import LLM, SamplingParams

    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0)
    print(PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(PREFIX + json.dumps({"seconds": seconds, "ids": [list(o.outputs[0].token_ids) for o in outputs]}),
              flush=True)


if __name__ == "__main__":
    main()
