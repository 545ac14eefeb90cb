"""PEFT adapters on the default model (SmolLM2-135M) and transformers + peft's greedy tokens for them,
with the logprob of each token (tests/logprob_parity.py).

Shared by tests/test_lora.py and tests/lora_tp_worker.py (the TP 2 subprocess, which reads the
references from a JSON file instead of running torch again)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

# name -> peft LoraConfig kwargs: several ranks and target sets, one with rslora
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp16rs": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]),
    "ko8": dict(r=8, lora_alpha=32, target_modules=["k_proj", "o_proj"]),
}
LORA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NUM_TOKENS = 8
B_STD = 0.1  # random B (PEFT initialises it to zeros): large enough that every adapter changes the output


def greedy(model, tokenizer, prompts: list[str], num_tokens: int) -> list[list[int]]:
    import torch

    ids = [tokenizer.encode(p) for p in prompts]  # one left-padded batch, as conftest's hf_greedy
    width, pad = max(map(len, ids)), tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    with torch.no_grad():
        gen = model.generate(input_ids, attention_mask=mask, max_new_tokens=num_tokens, do_sample=False,
                             pad_token_id=pad)
    return gen[:, width:].tolist()


def logprobs_of(model, prompt_ids: list[list[int]], tokens: list[list[int]]) -> list[list[float]]:
    from tests.logprob_parity import reference_logprobs

    return [reference_logprobs(model, p, t) for p, t in zip(prompt_ids, tokens)]


def make_adapters(hf_model, tokenizer, root: Path) -> dict:
    """Save each adapter under root/name (peft's save_pretrained) and return {"base": tokens,
    "base_logprobs": their logprobs, "prompt_ids", name: {"path", "tokens", "logprobs"}} with
    transformers + peft's greedy tokens and their float32 logprobs."""
    import torch
    from peft import LoraConfig, get_peft_model

    prompt_ids = [tokenizer.encode(p) for p in LORA_PROMPTS]
    base = greedy(hf_model, tokenizer, LORA_PROMPTS, NUM_TOKENS)
    refs: dict = {"base": base, "base_logprobs": logprobs_of(hf_model, prompt_ids, base), "prompt_ids": prompt_ids}
    for k, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = copy.deepcopy(hf_model)
        torch.manual_seed(k)  # A's init (peft's) draws from the global generator: the same adapters whatever ran before
        peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **kwargs))
        gen = torch.Generator().manual_seed(100 + k)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * B_STD)
        path = root / name
        peft_model.save_pretrained(str(path))
        tokens = greedy(peft_model.eval(), tokenizer, LORA_PROMPTS, NUM_TOKENS)
        refs[name] = {"path": str(path), "tokens": tokens, "logprobs": logprobs_of(peft_model, prompt_ids, tokens)}
        del peft_model, model
    return refs


def write_refs(refs: dict, path: Path) -> None:
    path.write_text(json.dumps(refs))


# ---- the multi-process LoRA tests (data parallel, --num-hosts) on conftest's tiny random Llama ----------
def make_tiny_adapters(model_dir: Path, root: Path) -> dict:
    """make_adapters on the tiny Llama at `model_dir` (its engines warm up in seconds, where the default
    model's take a minute per process), plus "texts": each generated token decoded alone, as a
    completion's `logprobs.tokens` reports it (the server returns no token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always NUM_TOKENS tokens (the server: ignore_eos)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    refs = make_adapters(model, tokenizer, root)
    for ref in [refs[name] for name in ADAPTERS]:
        ref["texts"] = [[tokenizer.decode([t]) for t in seq] for seq in ref["tokens"]]
    return refs


def http_lora_completions(url: str, names: list[str], prompt_ids: list[list[int]]) -> dict[str, dict]:
    """Every (adapter name, prompt) at once over HTTP, greedy: "name/i" -> {"texts", "logprobs"} of
    the generated tokens (compare_with_peft checks them)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(job: tuple[str, int]) -> dict:
        name, i = job
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": name, "prompt": prompt_ids[i], "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        return {"texts": lp["tokens"], "logprobs": lp["token_logprobs"]}

    jobs = [(name, i) for name in names for i in range(len(prompt_ids))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return {f"{n}/{i}": out for (n, i), out in zip(jobs, pool.map(one, jobs))}


def compare_with_peft(got: dict[str, dict], refs: dict) -> None:
    """The tokens (as texts) equal peft's greedy ones and each one's logprob is within
    LOGPROB_TOL of peft's float32 log_softmax (tests/logprob_parity.py)."""
    from tests.logprob_parity import assert_logprobs_close

    assert got, "no completions"
    for key, out in got.items():
        name, i = key.rsplit("/", 1)
        assert out["texts"] == refs[name]["texts"][int(i)], key
        assert_logprobs_close([out["logprobs"]], [refs[name]["logprobs"][int(i)]], what=key)
