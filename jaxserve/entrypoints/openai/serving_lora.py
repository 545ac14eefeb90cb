"""LoRA adapters over HTTP, as vLLM serves them.

    GET  /v1/models                  the base model, then one card per adapter (parent = base, root = path)
    POST /v1/load_lora_adapter       {"lora_name", "lora_path"}   only when VLLM_ALLOW_RUNTIME_LORA_UPDATING
    POST /v1/unload_lora_adapter     {"lora_name"}                (or JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING) is true

A completion or chat request picks an adapter by its `model` field (serving_engine.check_model);
an unknown name is a 404. An adapter is read and checked when it is loaded (a 400 naming the
field for DoRA, modules_to_save, a rank above --max-lora-rank, ...), so a bad one never reaches
a step. Unloading stops new requests naming it; requests already running finish under it.
"""

from __future__ import annotations

import os

import anyio
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jaxserve.entrypoints.openai import protocol as p
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.lora.manager import LoRAManager, ReplicatedLoRAManager
from jaxserve.lora.request import LoRAModulePath, LoRARequest

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str | None = None
    lora_int_id: int | None = None


def runtime_updating_enabled() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in RUNTIME_UPDATING_ENV)


def lora_manager(engine) -> LoRAManager | ReplicatedLoRAManager | None:
    return getattr(engine, "lora_manager", None)


def register_lora_modules(engine, modules: tuple[str, ...] | None) -> list[LoRARequest]:
    """`--lora-modules` entries served from start-up (ValueError naming the field on a bad one)."""
    if not modules:
        return []
    manager = lora_manager(engine)
    if manager is None:
        raise ValueError("lora_modules: needs --enable-lora")
    served = []
    for value in modules:
        module = LoRAModulePath.parse(value)
        served.append(manager.load(module.name, module.path, module.base_model_name))
    return served


def served_names(engine) -> tuple[str, ...]:
    """Every name the base model answers to (--served-model-name a b: both; the first is reported)."""
    return tuple(getattr(engine, "served_model_names", None) or (engine.model_name,))


def model_cards(engine) -> list[p.ModelCard]:
    cards = [p.ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
             for name in served_names(engine)]  # one card per --served-model-name, as vLLM
    manager = lora_manager(engine)
    for lora in manager.served() if manager is not None else []:
        cards.append(p.ModelCard(id=lora.lora_name, root=lora.lora_path,
                                 parent=lora.base_model_name or engine.model_name,
                                 max_model_len=engine.max_model_len))
    return cards


def lora_routes(engine, read_json, endpoint, max_body_bytes: int) -> list[Route]:
    """The runtime load/unload routes (empty unless runtime updating is allowed, as vLLM)."""
    if not runtime_updating_enabled():
        return []

    def manager_or_400() -> LoRAManager | ReplicatedLoRAManager:
        manager = lora_manager(engine)
        if manager is None:
            raise OpenAIError("LoRA is not enabled on this server (start it with --enable-lora)", param="lora_name")
        return manager

    async def load(request: Request) -> Response:
        req = await read_json(request, LoadLoRAAdapterRequest, max_body_bytes)
        if not req.lora_name or not req.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        manager = manager_or_400()
        if manager.resolve(req.lora_name) is not None or req.lora_name in served_names(engine):
            raise OpenAIError(f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        # (off the event loop: reads the files) The manager checks the name again, takes a fresh id,
        # reads and stores under one lock: concurrent loads never share an id or a name.
        await anyio.to_thread.run_sync(manager.load, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        req = await read_json(request, UnloadLoRAAdapterRequest, max_body_bytes)
        if not req.lora_name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        if manager_or_400().unregister(req.lora_name) is None:
            raise OpenAIError(f"The lora adapter '{req.lora_name}' cannot be found.", status=404,
                              param="lora_name", code="not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", endpoint(load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", endpoint(unload), methods=["POST"])]
