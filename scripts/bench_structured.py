"""Host time of the structured-output token bitmask per engine step, at N constrained rows.

    PYTHONPATH=. python scripts/bench_structured.py [--rows 64] [--steps 60] [--drafts 0]

Drives jaxserve.core.structured_output.StructuredOutputManager the way the engine does, with the
default model's tokenizer (49,152 tokens): N requests under different JSON schemas; each step fills
the [N * (1 + drafts), W] int32 bitmask (`fill_bitmask`, what LLMEngine.step calls before the
runner) and then advances every matcher by one token (`accept_updates`), a token drawn at random
among the allowed ones (so the walk covers keys, strings, numbers, nesting). A request that
completes is replaced by a fresh one. Prints the median and p90 of each part per step; no JAX,
no device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.core.scheduler_output import RequestUpdate, SampledToken, ScheduledRequest
from jaxserve.core.structured_output import StructuredOutputManager

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tag": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["id", "tag"]},
        "maxItems": 5}}, "required": ["items"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "ok": {"type": "boolean"}}, "required": ["zip", "score", "ok"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 30}]},
                                      "note": {"type": ["string", "null"]}}, "required": ["value", "note"]},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="constrained requests per step")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--drafts", type=int, default=0, help="speculative drafts per request (rows = rows * (1 + d))")
    args = ap.parse_args()
    from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer
    from jaxserve.weights.loader import default_model_path

    tokenizer = load_gguf_tokenizer(None, default_model_path())
    vocab = len(tokenizer)
    manager = StructuredOutputManager(tokenizer, vocab, (tokenizer.eos_token_id,))
    rng = np.random.default_rng(0)
    serial = 0

    def add() -> str:
        nonlocal serial
        rid = f"r{serial}"
        serial += 1
        so = StructuredOutputsParams(json=SCHEMAS[serial % len(SCHEMAS)])
        manager.add_request(rid, SamplingParams(structured_outputs=so))
        return rid

    ids = [add() for _ in range(args.rows)]
    t0 = time.perf_counter()
    while not all(manager.is_ready(r) for r in ids):
        time.sleep(0.001)
    compile_s = time.perf_counter() - t0
    fill_ms, accept_ms = [], []
    for _ in range(args.steps):
        scheduled = [ScheduledRequest(r, [0] * (1 + args.drafts), 0, [], True, num_drafts=args.drafts) for r in ids]
        t = time.perf_counter()
        bitmask = manager.fill_bitmask(scheduled)
        fill_ms.append((time.perf_counter() - t) * 1e3)
        updates = []
        for i, rid in enumerate(ids):
            row = bitmask[i * (1 + args.drafts)]
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
            updates.append(RequestUpdate(rid, [SampledToken(int(rng.choice(allowed)))]))
        t = time.perf_counter()
        manager.accept_updates(updates)
        accept_ms.append((time.perf_counter() - t) * 1e3)
        for i, rid in enumerate(ids):  # a finished request leaves; a new one takes its row
            matcher = manager.requests[rid].matcher
            if matcher is not None and matcher.is_stopped():
                manager.remove(rid)
                ids[i] = add()
        while not all(manager.is_ready(r) for r in ids):
            time.sleep(0.001)

    def q(xs: list[float], p: float) -> float:
        return float(np.percentile(xs, p))

    rows = args.rows * (1 + args.drafts)
    print(f"grammar compile (first {args.rows}, {len(SCHEMAS)} distinct schemas, incl. tokenizer): {compile_s:.2f} s")
    print(f"bitmask fill, {rows} rows x {bitmask.shape[1]} words: median {statistics.median(fill_ms):.2f} ms, "
          f"p90 {q(fill_ms, 90):.2f} ms per step")
    print(f"matcher advance, {args.rows} tokens: median {statistics.median(accept_ms):.2f} ms, "
          f"p90 {q(accept_ms, 90):.2f} ms per step")
    manager.shutdown()


if __name__ == "__main__":
    main()
