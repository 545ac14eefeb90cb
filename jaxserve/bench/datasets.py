"""Benchmark workloads: `random`, `sharegpt` (a local JSON file), `prefix-repetition`, and the
log-normal mixed workload of `bench batching`.

A dataset needs a tokenizer only to count and build prompts; anything with
`encode(text) -> list[int]` and `decode(ids) -> str` will do: the engine's own
(in-process benchmarks), `ServerTokenizer` (a server's /tokenize and /detokenize),
or `WordTokenizer` when the server offers neither (one word ~ one token, counted
approximately). Prompts are token ids when `as_ids` (for /v1/completions, which
takes them verbatim, so lengths are exact) and text otherwise.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Plain English words: most are one token with a leading space in BPE vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


class WordTokenizer:
    """The fallback when a server has no /tokenize: words are tokens (lengths are approximate)."""

    def encode(self, text: str) -> list[int]:
        return [WORDS.index(w) if w in WORDS else len(WORDS) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(WORDS[t % len(WORDS)] for t in token_ids)


class HFTokenizer:
    """A transformers tokenizer without special tokens added (the engine's, in-process)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids)


def token_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids of ordinary word tokens: random prompts built from them detokenize and re-tokenize cleanly."""
    ids = sorted(set(tokenizer.encode(" ".join(WORDS))))
    return ids or list(range(len(WORDS)))


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """Uniform in [mean*(1-ratio), mean*(1+ratio)] (vLLM's --random-range-ratio), at least 1."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _prompt(tokenizer: Tokenizer, ids: list[int], as_ids: bool) -> tuple[str | list[int], int]:
    if as_ids:
        return ids, len(ids)
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def random_requests(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0, as_ids: bool = True) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_pool(tokenizer))
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        prompt, n = _prompt(tokenizer, [int(t) for t in rng.choice(pool, size=int(n_in))], as_ids)
        requests.append(SampleRequest(prompt, n, int(n_out)))
    return requests


def prefix_repetition_requests(tokenizer: Tokenizer, num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, seed: int = 0,
                               as_ids: bool = True) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each prompt one of them plus its own random suffix; shuffled."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes: must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_pool(tokenizer))
    prefixes = [[int(t) for t in rng.choice(pool, size=prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + [int(t) for t in rng.choice(pool, size=suffix_len)]
        prompt, n = _prompt(tokenizer, ids, as_ids)
        requests.append(SampleRequest(prompt, n, output_len))
    random.Random(seed).shuffle(requests)
    return requests


def sharegpt_requests(path: str, tokenizer: Tokenizer, num_prompts: int, seed: int = 0,
                      output_len: int | None = None, as_ids: bool = False) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's token count as the output length (vLLM's filters:
    drop prompts or replies under 4 tokens, prompts over 1024 and pairs over 2048 tokens)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    requests = []
    for conv in convs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(conv[0]["value"])
        n_out = output_len or len(tokenizer.encode(conv[1]["value"]))
        n_in = len(prompt_ids)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        requests.append(SampleRequest(prompt_ids if as_ids else conv[0]["value"], n_in, n_out))
    if len(requests) < num_prompts:
        raise ValueError(f"dataset_path: {path} holds only {len(requests)} usable conversations, "
                         f"{num_prompts} asked for")
    return requests


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float,
                      lo: int, hi: int) -> list[int]:
    """Log-normal lengths (median, sigma of the log), rounded and clipped to [lo, hi]."""
    raw = median * np.exp(sigma * rng.standard_normal(n))
    return [int(x) for x in np.clip(np.round(raw), lo, hi)]


def mixed_requests(tokenizer: Tokenizer, num_prompts: int, input_median: int = 64, output_median: int = 64,
                   sigma: float = 0.7, max_len: int = 256, seed: int = 0) -> list[SampleRequest]:
    """The `bench batching` workload: log-normal prompt and output lengths in [4, max_len], token ids."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_pool(tokenizer))
    ins = lognormal_lengths(rng, num_prompts, input_median, sigma, 4, max_len)
    outs = lognormal_lengths(rng, num_prompts, output_median, sigma, 4, max_len)
    return [SampleRequest([int(t) for t in rng.choice(pool, size=i)], i, o) for i, o in zip(ins, outs)]


def add_dataset_args(parser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=("random", "sharegpt", "prefix-repetition"), default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-repetition-output-len", type=int, default=64)


def build_requests(args, tokenizer: Tokenizer, as_ids: bool) -> list[SampleRequest]:
    """The requests the parsed dataset flags describe."""
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed, as_ids)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_len, args.suffix_len,
                                          args.num_prefixes, args.prefix_repetition_output_len, args.seed,
                                          as_ids)
    if not args.dataset_path:
        raise ValueError("dataset_path: --dataset-name sharegpt needs --dataset-path FILE.json")
    return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.seed,
                             args.sharegpt_output_len, as_ids)
