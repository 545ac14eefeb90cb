"""The pooling routes (vLLM's shapes): /v1/embeddings, /score, /rerank (+ /v1, /v2), /classify, served
by build_app (api_server.py) when the engine's runner kind is "pooling", beside the routes every
server has (operator_routes.py) and with the same middleware, overload check and lifecycle.

    body --read_json--> request --tokenize (worker thread)--> AsyncLLM.encode per input (batched by
    the scheduler with every request in flight) --postprocess + JSON encode (worker thread)--> response

Tokenizing and serializing run in worker threads, so the event loop keeps accepting requests and
the engine thread only runs device steps. On a generate server these routes are a 400 naming the
runner, and on a pooling server the generation routes are.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.engine.exceptions import RequestAbortedError
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.serving_engine import BaseServing
from jaxserve.pooling import io

POOLING_ROUTES = ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify")
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")


class _Req(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None


class EmbeddingRequest(_Req):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None


class ScoreRequest(_Req):
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Req):
    query: str
    documents: list[str] | list[dict]
    top_n: int | None = None
    return_documents: bool = True


class ClassificationRequest(_Req):
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None


def wrong_runner(runner: str, path: str) -> OpenAIError:
    other = "pooling" if runner == "generate" else "generate"
    return OpenAIError(f"{path} is not served by this model: it runs with --runner {runner}, and {path} "
                       f"needs a model that runs with --runner {other}", status=400, code="wrong_runner")


class ServingPooling(BaseServing):
    """The pooling routes over an AsyncLLM (or its data-parallel front) of runner kind "pooling"."""

    def __init__(self, engine, metrics: ServerMetrics | None = None) -> None:
        super().__init__(engine, metrics)
        core = engine.core_engine  # an LLMEngine: the model's facts (every replica has the same)
        self.info, self.max_model_len = core.pooling_info, engine.max_model_len
        self.task = self.info.task or "embed"
        self.num_labels = getattr(core.model.config, "num_labels", 0)
        self.id2label = getattr(core.model.config, "id2label", ())
        self.dimension = core.pooler.dimension(core.model.config.hidden_size)

    def check_model(self, model: str | None) -> None:
        if super().check_model(model) is not None:  # a LoRA adapter's name (refused at start-up anyway)
            raise OpenAIError(f"The model `{model}` is an adapter; pooling models take none", param="model",
                              code="invalid_value")

    async def _pool(self, tokenized: list[io.TokenizedInput]) -> list[np.ndarray]:
        """Each input's result row; every input is one engine request (the scheduler batches them with
        every other request in flight), counted in /metrics as it finishes."""
        self.check_overload()
        base = f"pool-{uuid.uuid4().hex}"

        async def one(i: int, ids: list[int], types: list[int] | None) -> np.ndarray:
            start = time.monotonic()
            try:
                out = await self.engine.encode(ids, f"{base}-{i}", token_type_ids=types)
            except RequestAbortedError as e:
                raise OpenAIError(str(e), status=503, code="request_aborted") from None
            if self.metrics is not None:
                self.metrics.observe_pooled(len(ids), time.monotonic() - start)
            return out.outputs.data

        if len(tokenized) == 1:  # registered before the first await: a burst's next request counts it
            return [await one(0, *tokenized[0])]
        tasks = [asyncio.ensure_future(one(i, ids, types)) for i, (ids, types) in enumerate(tokenized)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one input failed (or the client left): the others are dropped, not left running
            for t in tasks:
                t.cancel()

    def _tokenize(self, inputs: list, truncate: int | None, add_special_tokens: bool = True) -> list[io.TokenizedInput]:
        return io.tokenize(self.tokenizer, inputs, truncate, self.max_model_len, len(self.tokenizer),
                           add_special_tokens, self.info.do_lower_case)

    async def embeddings(self, req: EmbeddingRequest) -> Response:
        self.check_model(req.model)
        if self.task != "embed":
            raise OpenAIError("/v1/embeddings needs an embedding model; this one classifies (use /score, /rerank "
                              "or /classify, or --convert embed)", code="wrong_task")
        if req.encoding_format not in ("float", "base64"):
            raise OpenAIError(f"encoding_format must be float or base64, got {req.encoding_format!r}",
                              param="encoding_format", code="invalid_value")
        inputs = io.as_inputs(req.input)
        io.check_dimensions(self.info, req.dimensions, self.dimension)
        tokenized = await asyncio.to_thread(self._tokenize, inputs, req.truncate_prompt_tokens, req.add_special_tokens)
        rows = await self._pool(tokenized)
        num_tokens = sum(len(t) for t, _ in tokenized)
        normalize = self.info.pooler.normalize

        def render() -> bytes:
            # orjson writes the float32 rows straight from numpy (each value's shortest float32 form):
            # about 10x json.dumps over tolist(), which held the GIL beside the engine's thread.
            data = [{"index": i, "object": "embedding",
                     "embedding": io.encode_embedding(io.embedding(r, req.dimensions, normalize), req.encoding_format)}
                    for i, r in enumerate(rows)]
            body = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": self.response_model(req.model), "data": data,
                    "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
            return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

        return Response(await asyncio.to_thread(render), media_type="application/json")

    async def _scores(self, firsts: list[str], seconds: list[str], truncate: int | None) -> tuple[list[float], int]:
        if self.task == "classify":
            if self.num_labels != 1:
                raise OpenAIError(f"scoring needs a cross-encoder with one label; this model has {self.num_labels}",
                                  code="wrong_task")
            tokenized = await asyncio.to_thread(io.tokenize_pairs, self.tokenizer, firsts, seconds,
                                                truncate or self.max_model_len, self.info.do_lower_case)
            rows = await self._pool(tokenized)
            act = self.info.score_activation and self.info.pooler.activation
            return [float(io.probabilities(r, act)[0]) for r in rows], sum(len(t) for t, _ in tokenized)
        uniq = list(dict.fromkeys(firsts + seconds))
        tokenized = await asyncio.to_thread(self._tokenize, uniq, truncate)
        rows = dict(zip(uniq, await self._pool(tokenized)))
        scores = [float(np.dot(rows[a], rows[b]) / max(np.linalg.norm(rows[a]) * np.linalg.norm(rows[b]), 1e-12))
                  for a, b in zip(firsts, seconds)]
        return scores, sum(len(t) for t, _ in tokenized)

    async def score(self, req: ScoreRequest) -> Response:
        self.check_model(req.model)
        firsts, seconds = io.pair_lists(req.text_1, req.text_2)
        scores, num_tokens = await self._scores(firsts, seconds, req.truncate_prompt_tokens)
        body = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.response_model(req.model),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
        return JSONResponse(body)

    async def rerank(self, req: RerankRequest) -> Response:
        self.check_model(req.model)
        if not req.documents:
            raise OpenAIError("documents must be a non-empty list", param="documents", code="invalid_value")
        texts = [d if isinstance(d, str) else str(d.get("text", "")) for d in req.documents]
        if req.top_n is not None and req.top_n < 1:
            raise OpenAIError(f"top_n must be >= 1, got {req.top_n}", param="top_n", code="invalid_value")
        scores, num_tokens = await self._scores([req.query] * len(texts), texts, None)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:req.top_n or len(texts)]
        results = [{"index": i, "document": {"text": texts[i]} if req.return_documents else None,
                    "relevance_score": scores[i]} for i in order]
        body = {"id": f"rerank-{uuid.uuid4().hex}", "model": self.response_model(req.model),
                "usage": {"total_tokens": num_tokens}, "results": results}
        return JSONResponse(body)

    async def classify(self, req: ClassificationRequest) -> Response:
        self.check_model(req.model)
        if self.task != "classify":
            raise OpenAIError("/classify needs a classification model", code="wrong_task")
        tokenized = await asyncio.to_thread(self._tokenize, io.as_inputs(req.input), req.truncate_prompt_tokens)
        rows = await self._pool(tokenized)
        labels = self.id2label
        data = []
        for i, r in enumerate(rows):
            probs = io.probabilities(r, self.info.pooler.activation)
            data.append({"index": i, "label": labels[int(np.argmax(probs))] if labels else str(int(np.argmax(probs))),
                         "probs": probs.tolist(), "num_classes": len(probs)})
        num_tokens = sum(len(t) for t, _ in tokenized)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": self.response_model(req.model), "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def pooling_routes(engine, metrics: ServerMetrics, max_body_bytes: int, max_num_queued_reqs: int | None) -> list[Route]:
    """The pooling routes of build_app (api_server.py) for a pooling engine; the generation routes
    answer a 400 naming the runner."""
    from jaxserve.entrypoints.openai.http import _endpoint, read_json

    serving = ServingPooling(engine, metrics)
    serving.max_num_queued_reqs = max_num_queued_reqs

    def route(path: str, model: type[BaseModel], method) -> Route:
        async def handler(request: Request) -> Response:
            return await method(await read_json(request, model, max_body_bytes))
        return Route(path, _endpoint(handler), methods=["POST"])

    def refuse(path: str) -> Route:
        async def handler(request: Request) -> Response:
            raise wrong_runner("pooling", path)
        return Route(path, _endpoint(handler), methods=["POST"])

    routes = [route("/v1/embeddings", EmbeddingRequest, serving.embeddings)]
    routes += [route(p, ScoreRequest, serving.score) for p in ("/score", "/v1/score")]
    routes += [route(p, RerankRequest, serving.rerank) for p in ("/rerank", "/v1/rerank", "/v2/rerank")]
    routes += [route("/classify", ClassificationRequest, serving.classify)]
    return routes + [refuse(p) for p in GENERATE_ROUTES]
