"""The TP 2 update_weights check for tests/test_weight_sync.py, run in a subprocess with 2 fake CPU devices.

    python -m tests.weight_sync_tp_worker JOB.json  ->  one JSON line: the greedy tokens and logprobs
    after an update with the merged weights given unsharded (numpy; jax arrays on device 0), whether
    every leaf kept its sharding, and the compilations the updates and the runs after them took.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from jaxserve.worker.programs import num_compilations
from tests.logprob_parity import generated_logprobs


def main(job_path: str) -> None:
    from tests.test_weight_sync import ENGINE

    job = json.loads(open(job_path).read())
    llm = LLM(job["base"], progress=False, tensor_parallel_size=2, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=job["num_tokens"], ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]

    def run() -> dict:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "logprobs": [generated_logprobs(o.outputs[0]) for o in outs]}

    assert run()["tokens"] == job["refs"]["base"]["tokens"]
    shardings = [x.sharding for x in jax.tree.leaves(llm.engine_params())]
    merged, base = load_file(job["merged"] + "/model.safetensors"), load_file(job["base"] + "/model.safetensors")
    # The engine skips warm-up (enforce_eager): its programs compile on first use. A run after an update
    # is a whole prefill (the prefix cache was emptied) fed the sampler's ids as the mesh holds them: one
    # such run first compiles that program, then the updates and runs are counted.
    llm.update_weights(base)
    assert run()["tokens"] == job["refs"]["base"]["tokens"]
    result = {}
    before = num_compilations()
    llm.update_weights(merged)  # numpy: assembled on the host, each device sent its slice
    result["numpy"] = run()
    llm.update_weights(base)  # back to the base, then the merged weights as jax arrays on one device
    assert run()["tokens"] == job["refs"]["base"]["tokens"]
    result["compilations_after_updates"] = num_compilations() - before
    device0 = jax.devices()[0]
    llm.update_weights({k: jax.device_put(jnp.asarray(v), device0) for k, v in merged.items()})
    result["jax"] = run()
    result["sharded_like_before"] = [x.sharding for x in jax.tree.leaves(llm.engine_params())] == shardings
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
