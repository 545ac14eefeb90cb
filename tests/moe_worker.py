"""Greedy tokens and their logprobs of MoE checkpoints under TP 2, TP 2 with expert parallelism and PP 2 (with and
without EP), in a subprocess with 4 fake CPU devices; one JSON object on the last line.

    python -m tests.moe_worker DIR [DIR ...]      # each DIR a tests/moe_fixtures checkpoint
    python -m tests.moe_worker --options '{"settings": {NAME: [[tp, pp, ep], ...]}, "prompts": [[id, ...], ...],
                                           "engine": {EngineArgs field: value, ...}}' DIR ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

from tests.moe_fixtures import engine_run, make_engine

# checkpoint -> [(tensor parallel, pipeline parallel, expert parallel)]: each family under TP 2, and
# under TP 2 with EP in PP 2 (one engine for both: 4 devices), as gpt-oss (tests/test_gpt_oss.py)
SETTINGS = {name: [(2, 1, False), (2, 2, True)] for name in ("qwen3_moe", "qwen2_moe", "mixtral")}


def expert_bytes_per_device(engine) -> dict[int, int]:
    tree = engine.pipeline.params if engine.pipeline is not None else engine.model.params
    out: dict[int, int] = {}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, x in leaves:
        if "we_" in jax.tree_util.keystr(path):
            for shard in x.addressable_shards:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def expert_spec(engine) -> str:
    """The PartitionSpec of the first stage's we_gate [L, E, I, H] (packed: of its first array)."""
    tree = engine.pipeline.params[0] if engine.pipeline is not None else engine.model.params
    if "we_gate" not in tree["layers"]:  # a dense checkpoint (tests/test_families.py)
        return ""
    return str(tuple(getattr(jax.tree.leaves(tree["layers"]["we_gate"])[0].sharding, "spec", ())))


def main(dirs: list[str], settings: dict = SETTINGS, prompts: list[list[int]] | None = None,
         engine_kw: dict | None = None) -> dict:
    results = {}
    for d in dirs:
        for tp, pp, ep in settings[Path(d).name]:
            engine = make_engine(Path(d), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 enable_expert_parallel=ep, **(engine_kw or {}))
            tokens, logprobs = engine_run(engine) if prompts is None else engine_run(engine, prompts)
            results[f"{Path(d).name}/tp{tp}/pp{pp}" + ("/ep" if ep else "")] = dict(
                tokens=tokens, logprobs=logprobs, compiles_after_warmup=engine.get_stats().num_compilations_after_warmup,
                expert_bytes=expert_bytes_per_device(engine), expert_spec=expert_spec(engine))
    return results


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--options"]:  # other checkpoints' settings and prompts (tests/test_gpt_oss.py)
        opts = json.loads(args[1])
        print(json.dumps(main(args[2:], opts["settings"], opts.get("prompts"), opts.get("engine"))))
    else:
        print(json.dumps(main(args)))
