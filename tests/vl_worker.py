"""Greedy tokens and logprobs of a tests/vl_fixtures checkpoint under tensor parallelism, in a subprocess with
fake CPU devices (tests/worker_run.run_json_worker); one JSON object on the last line.

    python -m tests.vl_worker DIR TP      # the prompts of tests/test_vl_parallel.PROMPTS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax


def main(path: str, tp: int) -> dict:
    from jaxserve import LLM
    from jaxserve.core.sampling_params import SamplingParams
    from tests.logprob_parity import generated_logprobs
    from tests.moe_fixtures import EXACT
    from tests.test_vl_parallel import MAX_TOKENS, prompts

    llm = LLM(str(Path(path)), progress=False, enforce_eager=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_memory=1 << 20, compilation_cache_dir="", tensor_parallel_size=tp,
              **EXACT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p
                         for p, imgs in prompts()], params, use_tqdm=False)
    tree = llm.llm_engine.runner.params
    result = dict(prompt_ids=[list(o.prompt_token_ids) for o in outs],
                  tokens=[list(o.outputs[0].token_ids) for o in outs],
                  logprobs=[generated_logprobs(o.outputs[0]) for o in outs],
                  devices=len(jax.devices()),
                  wq_spec=str(tuple(tree["layers"]["wq"].sharding.spec)),
                  vision_devices=len(tree["vision"]["blocks"]["qkv"].sharding.device_set),
                  vision_spec=str(tuple(tree["vision"]["blocks"]["qkv"].sharding.spec)))
    return {**result, "http": _over_http(llm)}


def _over_http(llm) -> dict:
    """The same engine behind the real OpenAI app: a chat with prompts()[1]'s image as a data URL, whose
    ChatML rendering is prompts()[1]'s prompt (tests/vl_fixtures.CHAT_TEMPLATE)."""
    import base64
    import io

    import httpx

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.fake_engine import serve_in_thread
    from tests.test_vl_parallel import MAX_TOKENS, prompts

    buf = io.BytesIO()
    prompts()[1][1][0].save(buf, format="PNG")  # lossless: the same pixels
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    engine = AsyncLLM(llm.llm_engine)
    try:
        with serve_in_thread(build_app(engine)) as base:
            body = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
                "model": llm.llm_engine.model_name, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "logprobs": True, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]})
            body.raise_for_status()
            choice = body.json()["choices"][0]
            return dict(text=choice["message"]["content"], usage=body.json()["usage"],
                        logprobs=[t["logprob"] for t in choice["logprobs"]["content"]])
    finally:
        engine.shutdown()

if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
