"""The TP 2 check of the LoRA Pallas kernel for tests/test_lora_pallas.py, run in a subprocess with
2 fake CPU devices.

    python -m tests.lora_kernel_tp_worker  ->  one JSON line: for a column-split (q) and a
    row-split (o) projection, the kernel's delta (interpret mode, inside shard_map) against the XLA
    one-hot product; and the sharded decode program with LoRA slots lowered for cuda.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve import parallel
from jaxserve.lora import layers
from jaxserve.models.config import ModelConfig

# every projection splits over 2 devices into the kernel's 64-wide tiles
CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=256, intermediate_size=512,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def check_delta(mesh, name: str, spec_a: P, spec_b: P, spec_x: P) -> dict:
    k, n, num_slots, rank, m = 256, 256, 4, 16, 16
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    slots = jnp.asarray(rng.integers(0, num_slots + 1, m), jnp.int32)
    ab = {"a": jnp.asarray(rng.standard_normal((k, num_slots * rank)) / np.sqrt(k), jnp.float32),
          "b": jnp.asarray(rng.standard_normal((num_slots * rank, n)), jnp.float32)}
    owner = (jnp.arange(num_slots * rank, dtype=jnp.int32) // rank + 1).reshape(num_slots, rank)
    want = np.asarray(layers.delta(x, ab, layers.slot_mask(slots, owner)))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    xs, ss, os_ = put(x, spec_x), put(slots, P()), put(owner, P())
    abs_ = {"a": put(ab["a"], spec_a), "b": put(ab["b"], spec_b)}

    def run(x, slots, owner, ab, kernel):
        return layers.delta(x, ab, layers.step_inputs(slots, owner, kernel), name)

    step = jax.jit(lambda *a: run(*a, "interpret"))
    got, text = np.asarray(step(xs, ss, os_, abs_)), step.lower(xs, ss, os_, abs_).as_text()
    return {"rel": float(np.abs(got - want).max() / np.abs(want).max()), "changes": bool(np.abs(want).max() > 0),
            "all_reduce": "all_reduce" in text or "all-reduce" in text}


def lowered_decode(mesh) -> dict:
    from tests.test_lora_pallas import kernel_calls, lowered_step

    tp = parallel.tensor_parallel_size(mesh)
    specs = parallel.partition_plan(CFG, tp).specs

    def shard(params):  # the shapes placed as the engine places them (parallel.shard_params, layers.shard_slots)
        placed = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
        lora = params["layers"]["lora"]
        base = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "lora"}}
        del base["lora_owner"]
        out = jax.tree.map(lambda s, a: placed(a, s), specs, base, is_leaf=lambda s: isinstance(s, P))
        lora_specs = layers.slot_specs(lora, specs["layers"])
        out["layers"]["lora"] = {m: {k: placed(v, lora_specs[m][k]) for k, v in ab.items()} for m, ab in lora.items()}
        out["lora_owner"] = placed(params["lora_owner"], P())
        return out

    text = lowered_step(CFG, 16, decode_only=True, shard=shard)
    return {"kernel_calls": kernel_calls(text), "shard_map": "manual_computation" in text or "shard_map" in text}


def main() -> None:
    mesh = parallel.make_mesh(2, 1)
    out = {"column": check_delta(mesh, "wq", P(), P(None, "model"), P()),
           "row": check_delta(mesh, "wo", P("model", None), P(), P(None, "model")),
           "lowered": lowered_decode(mesh)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
