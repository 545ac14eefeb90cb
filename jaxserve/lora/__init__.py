"""Multi-LoRA serving (vLLM's `--enable-lora`): PEFT adapters on one base model, batched.

    request.py   LoRARequest (vLLM's class and import path)
    peft.py      read a PEFT adapter directory into per-projection A/B arrays (host, numpy)
    manager.py   the adapters an engine knows (names, ids, paths) and their host copies (LRU)
    layers.py    the device side: stacked slots, the slot write, x @ A[slot] @ B[slot] in the step
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
