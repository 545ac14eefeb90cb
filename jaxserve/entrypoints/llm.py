"""The offline API, vLLM-compatible: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.weights.loader import LoadedModel


class LLM:
    """An engine in this process. `model=None` serves the default model (SmolLM2-135M-Instruct).

    Keyword arguments are EngineArgs fields (max_num_seqs, enable_prefix_caching, ...); `model` may
    also be a LoadedModel from `jaxserve.weights.loader.load_model`, to reuse weights already in memory.
    """

    def __init__(self, model: str | LoadedModel | None = None, *, progress: bool = True, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not an engine argument; known: {', '.join(EngineArgs.field_names())}")
        # An already loaded model (e.g. to try several engine settings on the same weights) is used as is.
        loaded = model if isinstance(model, LoadedModel) else None
        args = EngineArgs(model=None if loaded else model, **engine_args)
        self.llm_engine = LLMEngine(args, model=loaded, progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            return_dict=False))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending, results = set(ids), {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
