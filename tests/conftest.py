"""Shared fixtures: the real default model (SmolLM2-135M-Instruct, GGUF Q4_1) in jaxserve and in transformers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from jaxserve.weights.loader import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List of prime numbers: 2, 3, 5,",
    "The quick brown fox",
    "In machine learning, a neural network is",
]


# --- test engines compile only what they run --------------------------------------------------------
# An engine's warm-up compiles every token bucket, decode bucket and sampler variant: most tests run a
# few prompts and need a handful of those programs, so by default a test's engine starts with
# enforce_eager (the same programs, compiled on first use). A test or module that holds the warm-up's
# guarantee (0 compilations after it) is marked `@pytest.mark.warmup` and gets the engine as built.
_WARMUP = {"module": False, "test": False}


@pytest.fixture(scope="session", autouse=True)
def _eager_unless_warmup() -> Iterator[None]:
    import dataclasses

    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    init = LLMEngine.__init__

    def eager_init(self: LLMEngine, args: EngineArgs, *a: object, **kw: object) -> None:
        if not (_WARMUP["module"] or _WARMUP["test"]) and not args.enforce_eager:
            args = dataclasses.replace(args, enforce_eager=True)
        init(self, args, *a, **kw)

    LLMEngine.__init__ = eager_init
    yield
    LLMEngine.__init__ = init


@pytest.fixture(scope="module", autouse=True)
def _warmup_module(request: pytest.FixtureRequest, _eager_unless_warmup: None) -> Iterator[None]:
    _WARMUP["module"] = request.node.get_closest_marker("warmup") is not None  # the module's pytestmark
    yield
    _WARMUP["module"] = False


@pytest.fixture(autouse=True)
def _warmup_test(request: pytest.FixtureRequest, _warmup_module: None) -> Iterator[None]:
    _WARMUP["test"] = request.node.get_closest_marker("warmup") is not None
    yield
    _WARMUP["test"] = False


@pytest.fixture(scope="session")
def default_gguf():
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_gguf):
    """A tiny random Llama (4 heads, 2 kv heads: both split at TP 2) saved by transformers, with the
    default model's tokenizer: for the tests that need a real HF directory but no real weights."""
    import torch
    import transformers
    from jaxserve.weights.gguf_file import open_gguf
    from jaxserve.weights.gguf_tokenizer import load_gguf_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    load_gguf_tokenizer(open_gguf(default_gguf), default_gguf).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_lora_refs(tiny_llama_dir, tmp_path_factory) -> dict:
    """peft adapters on tiny_llama_dir and transformers + peft's greedy tokens and logprobs for them
    (tests/lora_helpers.py): the multi-process LoRA tests' reference (data parallel, --num-hosts)."""
    from tests.lora_helpers import make_tiny_adapters

    return make_tiny_adapters(tiny_llama_dir, tmp_path_factory.mktemp("tiny_adapters"))


@pytest.fixture(scope="session")
def jax_default_model():
    from jaxserve.weights.loader import load_model

    return load_model(None, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def hf_default_model(default_gguf):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # always 48 tokens: EOS is just another token here
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def hf_greedy(hf_default_model, hf_default_tokenizer):
    """prompt -> (prompt ids, 48 greedy ids, the reference logits at each generated position)."""
    import torch

    # One left-padded batch: 48 forward steps instead of 8 x 48.
    ids = [hf_default_tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, ids))
    pad = hf_default_tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    torch.manual_seed(0)
    with torch.no_grad():
        gen = hf_default_model.generate(input_ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                                        output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    logits = torch.stack(gen.logits, 1).float().numpy()  # [batch, 48, vocab]
    return {p: (i, gen.sequences[b, width:].tolist(), logits[b]) for b, (p, i) in enumerate(zip(PROMPTS, ids))}


# --- one real server for the session (tests/test_server_real.py, tests/test_structured_real.py) ------------
# Buckets are kept few (max_num_batched_tokens=64 with chunked prefill: token buckets 16/32/64,
# sequence buckets 8/16) so the warm-up stays short on a 2-core CPU.
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
# A float32 pool, not the CPU's bfloat16 default: the tests hold greedy outputs independent of the
# batch, and rounding K and V to bfloat16 can flip a near-tie when the batch (so the sums' order) changes.
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=64, enable_chunked_prefill=True,
              block_size=16, num_gpu_blocks_override=128, dtype="float32", kv_cache_dtype="auto")
GREEDY_PROMPTS = PROMPTS[:3]
GREEDY_TOKENS = 16
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]]
CHAT_TOKENS = 16
OFFLINE_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["city", "rank"], "additionalProperties": False}
# (prompt, StructuredOutputsParams kwargs, SamplingParams kwargs): vLLM's offline structured outputs
OFFLINE_STRUCTURED = [("A city as JSON:", {"json": OFFLINE_SCHEMA}, {"temperature": 0.8, "seed": 5, "n": 2}),
                      ("Is water wet? Answer:", {"choice": ["yes", "no"]}, {"temperature": 0.0})]


@dataclass
class Served:
    """The session's real server: its URL, the engine behind it, greedy references."""

    url: str
    engine: object  # AsyncLLM
    completions: dict[str, object]  # prompt -> offline greedy RequestOutput, GREEDY_TOKENS tokens
    chats: list[object]  # offline greedy chat RequestOutputs, up to CHAT_TOKENS tokens
    structured: list[object]  # offline RequestOutputs under OFFLINE_STRUCTURED (tests/test_structured_real.py)


@pytest.fixture(scope="module")
def served(jax_default_model) -> Iterator[Served]:
    """The default model behind the OpenAI app on a real uvicorn server; greedy references from the
    offline API on the same engine first, so no second warm-up is paid. Module-scoped: the engine
    (its pool and compiled programs) is released when the module is done."""
    from jaxserve import LLM, SamplingParams, StructuredOutputsParams
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread

    llm = LLM(jax_default_model, progress=False, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    completions = dict(zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)))
    chats = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS), use_tqdm=False)
    structured = llm.generate([p for p, _, _ in OFFLINE_STRUCTURED], [
        SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(**so), **kw)
        for _, so, kw in OFFLINE_STRUCTURED], use_tqdm=False)
    engine = AsyncLLM(llm.llm_engine)  # the engine thread owns it from here on
    try:
        with serve_in_thread(build_app(engine)) as url:
            yield Served(url, engine, completions, chats, structured)
    finally:
        engine.shutdown()


