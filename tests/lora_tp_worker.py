"""The TP 2 LoRA check for tests/test_lora.py, run in a subprocess with 2 fake CPU devices.

    python -m tests.lora_tp_worker REFS.json  ->  one JSON line: the greedy tokens and their logprobs
    of every (adapter or base, prompt) pair of one mixed batch, and the compilations after warm-up.
"""

from __future__ import annotations

import json
import sys

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.weights.loader import load_model
from tests.logprob_parity import generated_logprobs
from tests.lora_helpers import ADAPTERS, NUM_TOKENS


def main(refs_path: str) -> None:
    from tests.test_lora import LORA_ENGINE

    refs = json.loads(open(refs_path).read())
    llm = LLM(load_model(None, dtype="float32", progress=False), progress=False, **LORA_ENGINE,
              tensor_parallel_size=2)
    names = [None] + list(ADAPTERS)  # 4 adapters over 3 slots
    prompts, loras, keys = [], [], []
    for k, name in enumerate(names):
        for i, ids in enumerate(refs["prompt_ids"]):
            prompts.append({"prompt_token_ids": ids})
            loras.append(None if name is None else LoRARequest(name, k, refs[name]["path"]))
            keys.append(f"{name or 'base'}/{i}")
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)  # as test_lora's GREEDY
    outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
    stats = llm.llm_engine.get_stats()
    print(json.dumps({"tokens": {k: o.outputs[0].token_ids for k, o in zip(keys, outs)},
                      "logprobs": {k: generated_logprobs(o.outputs[0]) for k, o in zip(keys, outs)},
                      "compilations_after_warmup": stats.num_compilations_after_warmup}))


if __name__ == "__main__":
    main(sys.argv[1])
