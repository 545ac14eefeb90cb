"""The offline API, vLLM-compatible: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.engine import beam_search
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.weights.loader import LoadedModel
from jaxserve.lora.request import LoRARequest
from jaxserve.multimodal.chat import chat_images


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
        self._ids = itertools.count()
        self.llm_engine = LLMEngine(args, model=loaded, progress=progress)

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              use_tqdm: bool = False) -> list:
        """EmbeddingRequestOutput per prompt (`.outputs.embedding`); a pooling model only."""
        from jaxserve.entrypoints import pooling_offline as offline

        return offline.embed(self._pooling_engine("embed"), prompts, truncate_prompt_tokens, dimensions)

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list:
        """ClassificationRequestOutput per prompt (`.outputs.probs`)."""
        from jaxserve.entrypoints import pooling_offline as offline

        return offline.classify(self._pooling_engine("classify"), prompts, truncate_prompt_tokens)

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list:
        """ScoringRequestOutput per pair (`.outputs.score`): a cross-encoder's, or the embeddings' cosine."""
        from jaxserve.entrypoints import pooling_offline as offline

        return offline.score(self._pooling_engine("score"), text_1, text_2, truncate_prompt_tokens)

    def _pooling_engine(self, method: str):
        if self.llm_engine.runner_kind != "pooling":
            raise ValueError(f"runner: {method}() needs a pooling model (runner='pooling'); this LLM runs "
                             "runner='generate'")
        return self.llm_engine

    # ---- lifecycle: `with LLM(...) as llm:`, `llm.shutdown()`, or drop it ---------------------------
    def shutdown(self) -> None:
        """Free the engine's KV pool, the weights it loaded and its compiled programs; idempotent."""
        self.llm_engine.shutdown()

    close = shutdown

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # ---- sleep mode (vLLM's; engine/sleep.py): free the device between RL steps ---------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and take the weights off the device: level 1 keeps them in host memory,
        level 2 drops them (update_weights brings new ones). Generating while asleep is an error."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back "weights" and/or "kv_cache" (None: both; weights first, then the pool, lets an
        update land before the pool is allocated). Nothing is recompiled."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    # ---- weights in and out, in process (RL; engine/weight_sync.py, docs/rl.md) ---------------------
    def get_weights(self) -> dict:
        """The served weights as {Hugging Face name: jax.Array}, unfused, in HF's layout."""
        return self.llm_engine.get_weights()

    def engine_params(self) -> dict:
        """The engine's own param tree (stacked layers, [in, out]): update_weights adopts it with no copy."""
        return self.llm_engine.engine_params()

    def update_weights(self, weights: dict, *, version=None) -> None:
        """Serve new weights from the next step: get_weights()' names (any subset) or engine_params()' tree."""
        self.llm_engine.update_weights(weights, version=version)

    def update_weights_from_disk(self, model_path: str, version=None) -> None:
        """update_weights from an HF safetensors directory or a `jaxserve convert` checkpoint of this model."""
        self.llm_engine.update_weights_from_disk(model_path, version=version)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt, as vLLM."""
        if self.llm_engine.runner_kind == "pooling":
            raise ValueError("runner: generate() needs a generative model; this LLM runs runner='pooling' "
                             "(use embed, score or classify)")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        beam = [i for i, p in enumerate(params) if p.use_beam_search]
        if beam and any(loras):
            raise ValueError("lora_request: not supported with beam search")
        if beam:
            plain = [i for i in range(len(prompts)) if i not in set(beam)]
            results = dict(zip(beam, self.beam_search([prompts[i] for i in beam], [params[i] for i in beam])))
            if plain:
                results.update(zip(plain, self.generate([prompts[i] for i in plain], [params[i] for i in plain],
                                                        use_tqdm)))
            return [results[i] for i in range(len(prompts))]
        engine = self.llm_engine
        engine.check_can_generate()  # asleep, paused or without weights: an error, not a wait forever
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams() with the model's generation config defaults (--generation-config;
        engine/generation_config.py) laid over; what generate() and chat() use when given none."""
        return SamplingParams(**getattr(self.llm_engine, "default_sampling_params", {}))

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams | SamplingParams | Sequence[SamplingParams],
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput] | list[RequestOutput]:
        """vLLM's form: `beam_search(prompts, BeamSearchParams(beam_width=W, max_tokens=T))` -> one
        BeamSearchOutput per prompt (`.sequences`: W beams, best first, each `.tokens`, `.text` with the
        prompt, `.cum_logprob`), `concurrency_limit` prompts searched at a time. The older form,
        `SamplingParams(use_beam_search=True, beam_width=W, n=N, ...)`, gives RequestOutputs."""
        if lora_request is not None:
            raise ValueError("lora_request: not supported with beam search")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            return [beam_search.to_output(str(next(self._ids)), text, ids, beams, self._beam_decode(True))
                    for text, ids, beams in self._beam_rounds(list(prompts), params)]
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        prompts, sp = list(prompts), beam_search.as_sampling_params(params)
        step = concurrency_limit or max(len(prompts), 1)
        results = [r for i in range(0, len(prompts), step) for r in self._beam_rounds(prompts[i:i + step], sp, True)]
        return [beam_search.to_vllm_output(ids, beams, self._beam_decode(False)) for _, ids, beams in results]

    def _beam_decode(self, skip_special_tokens: bool):
        tok = self.llm_engine.tokenizer
        return (lambda t: tok.decode(t, skip_special_tokens=skip_special_tokens)) if tok else (lambda t: "")

    def _beam_rounds(self, prompts: list[PromptType], params: SamplingParams | Sequence[SamplingParams],
                     vllm_score: bool = False) -> list[tuple[str | None, list[int], list[beam_search.Beam]]]:
        """(prompt text, prompt ids, the best beams) per prompt; every prompt's beams of a round run together."""
        engine = self.llm_engine
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        encoded = [engine.encode_prompt(p) for p in prompts]
        for (_, ids), p in zip(encoded, params):
            beam_search.check(p, engine.args.max_logprobs)
            engine.validate(ids, dataclasses.replace(p, use_beam_search=False))
        searches = [beam_search.search(ids, p, engine.max_model_len, engine.eos_token_ids, vllm_score)
                    for (_, ids), p in zip(encoded, params)]
        rounds: dict[int, list[list[int]]] = {}
        results: dict[int, list[beam_search.Beam]] = {}

        def advance(i: int, candidates=None) -> None:
            try:
                rounds[i] = searches[i].send(candidates)
            except StopIteration as stop:
                rounds.pop(i, None)
                results[i] = stop.value

        for i in range(len(prompts)):
            advance(i)
        while rounds:  # all prompts' beams of one round go to the engine together
            batch = [(i, ids) for i in sorted(rounds) for ids in rounds[i]]
            step = {i: beam_search.step_params(params[i], beam_search.width_of(params[i])) for i in rounds}
            outs = self.generate([{"prompt_token_ids": ids} for _, ids in batch], [step[i] for i, _ in batch],
                                 use_tqdm=False)
            for i in list(rounds):
                advance(i, [beam_search.candidates_from(o) for (j, _), o in zip(batch, outs) if j == i])
        return [(text, ids, results[i]) for i, (text, ids) in enumerate(encoded)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            mm = getattr(self.llm_engine, "mm_processor", None)  # image parts (multimodal/chat.py), under the flags
            conv, images = chat_images(conv, getattr(mm, "media", None), getattr(mm, "limit", None))
            ids = list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                               chat_template=chat_template, return_dict=False))
            prompts.append({"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

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
