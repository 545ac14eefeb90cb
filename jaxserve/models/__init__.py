"""The model code: one module per family (registry.py says which serves which architecture).

`jaxserve.models.forward(params, token_ids, positions, *, config)` is the training forward
(training.py): pure, differentiable logits over the engine's own param tree. Imported on first
use, so `import jaxserve.models.<module>` stays as light as it was."""

from __future__ import annotations

from typing import Any

__all__ = ["forward", "token_logprobs"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jaxserve.models import training

        return getattr(training, name)
    raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
