"""Where `jaxserve plan` reads a model's config from: jaxserve/weights/source.py's description in its
config-only form (no weights needed: a cached config.json or a bundled config will do). Never the network."""

from __future__ import annotations

from jaxserve.weights.source import DEFAULT_HUB_ID, DEFAULT_MODEL, ModelSource, bundled_ids, describe_model

__all__ = ["DEFAULT_HUB_ID", "DEFAULT_MODEL", "ModelSource", "bundled_ids", "read_model"]


def read_model(model: str | None) -> ModelSource:
    """The config of `model`; FileNotFoundError naming what was tried."""
    return describe_model(model, config_only=True)
