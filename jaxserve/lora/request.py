"""`LoRARequest`: which adapter a request runs under, as vLLM spells it.

    LoRARequest("sql-lora", 1, "/adapters/sql")          # positional: name, int id, path
    llm.generate(prompts, params, lora_request=LoRARequest(...))

`lora_int_id` is the adapter's identity inside the engine (scheduler, slots, prefix
cache); it must be >= 1 (0 is the base model). Two requests with the same id must
name the same adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: must name the adapter's directory")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter served by name from start-up."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: str) -> "LoRAModulePath":
        """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
        import json

        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {value!r} is not valid JSON: {e}") from None
            if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
                raise ValueError(f"lora_modules: {value!r} needs \"name\" and \"path\"")
            return cls(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {value!r} must be name=path or a JSON object")
        return cls(name, path)
