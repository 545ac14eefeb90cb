"""--batch-invariant's cost on the default model: greedy tok/s of one batch with and without, and whether
a request's logprobs are bitwise the same alone and in that batch.

    python scripts/bench_batch_invariant.py --batch-invariant 0   # then 1; alternate runs on a busy host
"""

from __future__ import annotations

import argparse
import time

from jaxserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "List of prime numbers: 2, 3, 5,",
           "The quick brown fox", "In machine learning, a neural network is"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-invariant", type=int, choices=(0, 1), required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(None, progress=False, batch_invariant=bool(a.batch_invariant), max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, speculative_config={})
    prompts = (PROMPTS * (a.num_prompts // len(PROMPTS) + 1))[:a.num_prompts]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0]
    llm.generate(prompts, sp, use_tqdm=False)  # every program this run takes, compiled and warm
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = outs[0].outputs[0]
    same = ([e[t].logprob for e, t in zip(alone.logprobs, alone.token_ids)]
            == [e[t].logprob for e, t in zip(first.logprobs, first.token_ids)])
    print(f"batch_invariant={bool(a.batch_invariant)}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} "
          f"tok/s; alone == in the batch of {a.num_prompts}, bitwise: {same}")


if __name__ == "__main__":
    main()
