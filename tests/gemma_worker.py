"""Greedy tokens and their logprobs of tiny Gemma checkpoints at tensor parallel size 2, in a subprocess
with 2 fake CPU devices (tests/test_gemma.py); one JSON object on the last line.

    python -m tests.gemma_worker '{"prompts": [[id, ...], ...], "max_tokens": N}' DIR [DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.moe_fixtures import engine_run, make_engine


def main(dirs: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    results = {}
    for d in dirs:
        engine = make_engine(Path(d), tensor_parallel_size=2, enforce_eager=True)
        try:
            spec = engine.model.params["layers"]["wq"].sharding.spec  # the q heads split over the 2 devices
            tokens, logprobs = engine_run(engine, prompts, max_tokens)
            results[Path(d).name] = dict(tokens=tokens, logprobs=logprobs, wq_spec=str(tuple(spec)))
        finally:
            engine.shutdown()
    return results


if __name__ == "__main__":
    opts = json.loads(sys.argv[1])
    print(json.dumps(main(sys.argv[2:], opts["prompts"], opts["max_tokens"])))
