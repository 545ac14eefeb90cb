"""Structured outputs through the engine on the default model with everything that moves a grammar's
state at once: async scheduling, n-gram drafts (draft rows masked by the advanced matcher), a KV pool
small enough to preempt, n > 1. Every output must satisfy its constraint and end with "stop", the
repetitive regex must have accepted drafts, and nothing may compile after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
REGEX = "(abc ){6}end"
# ~30 tokens of context per prompt: 8 sequences need ~32 blocks of 8 tokens; the pool has 12
CONTEXT = "Some context about the weather in the mountains and by the sea, today and tomorrow. " * 2


@pytest.mark.warmup  # holds 0 compilations after warm-up
def test_grammars_under_async_drafts_and_preemption(jax_default_model) -> None:
    llm = LLM(jax_default_model, progress=False, max_model_len=96, block_size=8, num_gpu_blocks_override=12,
              max_num_seqs=16, max_num_batched_tokens=128, dtype="float32", async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    cases = ([(CONTEXT + "A user as JSON:", SamplingParams(temperature=0.0, max_tokens=40,
                                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)))] * 3
             + [(CONTEXT + "Repeat after me:", SamplingParams(temperature=0.0, max_tokens=40,
                                                    structured_outputs=StructuredOutputsParams(regex=REGEX)))] * 2
             + [(CONTEXT + "Pick one:", SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=8,
                                             structured_outputs=StructuredOutputsParams(choice=["left", "right"])))]
             + [(CONTEXT + "Hello", SamplingParams(temperature=0.0, max_tokens=24, bad_words=["the"],
                                                   ignore_eos=True))])
    outs = llm.generate([p for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)
    for out in outs[:3]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    for out in outs[3:5]:
        assert re.fullmatch(REGEX, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert len(outs[5].outputs) == 2 and all(o.text in ("left", "right") for o in outs[5].outputs)
    assert " the " not in outs[6].outputs[0].text
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.num_compilations_after_warmup == 0
    assert not llm.llm_engine.scheduler.structured.requests  # every matcher released
