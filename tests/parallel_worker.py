"""Multi-device checks for tests/test_parallel.py, run in a subprocess.

The device count is fixed when jax initialises, and the main pytest process has
already initialised it with one CPU device; so tests/test_parallel.py runs this
file with XLA_FLAGS=--xla_force_host_platform_device_count=8 and reads back
one JSON line per check.

    python -m tests.parallel_worker families,layout,loading
    python -m tests.parallel_worker default_model REF.json
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import llama
from jaxserve.models.attention import AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve import parallel

BASE = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96,
            num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8, rms_norm_eps=1e-5,
            max_position_embeddings=256)

# name -> overrides of BASE; every family splits its attention at TP 2, 4 and 8 (8 heads)
# except where the kv heads are fewer than the model axis (replicated kv groups).
FAMILIES: dict[str, dict] = {
    "llama_mha": dict(num_kv_heads=8),
    "llama_gqa": dict(num_kv_heads=4, rope_theta=500000.0),
    "mistral_sliding": dict(architecture="MistralForCausalLM", num_kv_heads=4, sliding_window=6),
    "qwen2_bias_tied": dict(architecture="Qwen2ForCausalLM", num_kv_heads=4, attention_bias=True,
                            tie_word_embeddings=True),
    "qwen3_qknorm": dict(architecture="Qwen3ForCausalLM", num_kv_heads=4, head_dim=16, qk_norm=True),
    "llama_kv_fewer": dict(num_kv_heads=2),  # 2 kv heads < model axis 4 and 8
}
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Host (numpy) params; norms near 1 and weights large enough that logits are far from uniform."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = path[-1].key
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        scale = 0.1 if name.startswith("b") else 2.0 / np.sqrt(shape[-2] if len(shape) > 1 else 64)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, llama.param_shapes(cfg),
                                            is_leaf=lambda x: isinstance(x, tuple))


class PagedDriver:
    """A ragged prefill then batched decode steps through the paged pool on one mesh (like
    tests/paged_helpers.py), each step padded to `pad_tokens` (one static shape) or, when
    None, to a power-of-two bucket. Block 0 holds garbage and blocks are handed out scrambled."""

    def __init__(self, cfg: ModelConfig, mesh, params, *, block_size: int = 4, num_blocks: int = 32,
                 max_seqs: int = 4, pad_tokens: int | None = 24):
        self.cfg, self.mesh, self.params = cfg, mesh, params
        self.block_size, self.max_seqs, self.pad_tokens = block_size, max_seqs, pad_tokens
        self.max_blocks = num_blocks // max_seqs
        self.shardings = parallel.ModelShardings.create(mesh, cfg)
        kv = parallel.make_sharded_kv_cache(mesh, cfg, num_blocks, block_size, params["embed"].dtype)
        self.kv = tuple(c.at[:, :, 0].set(v) for c, v in zip(kv, (1e4, -1e4)))
        self.free = list(np.random.default_rng(0).permutation(np.arange(1, num_blocks)))
        self.step = parallel.jit_sharded_step(self._step, self.shardings)
        self.blocks: list[list[int]] = []
        self.lens: list[int] = []
        self.batch = None  # the last step's inputs, to lower the step for its HLO

    def _step(self, params, kv, batch):
        tokens, positions, md, last = batch
        kv, hidden = llama.forward(params, self.cfg, kv, tokens, positions, md, "xla")
        return kv, llama.compute_logits(params, hidden[last])

    def run(self, new_tokens: list[list[int]]) -> np.ndarray:
        """Logits [len(new_tokens), vocab] at each sequence's last new token."""
        if not self.blocks:
            self.blocks, self.lens = [[] for _ in new_tokens], [0] * len(new_tokens)
        toks, pos, slots, q_lens = [], [], [], []
        for i, new in enumerate(new_tokens):
            for t in new:
                if self.lens[i] % self.block_size == 0:
                    self.blocks[i].append(int(self.free.pop()))
                slots.append(self.blocks[i][-1] * self.block_size + self.lens[i] % self.block_size)
                toks.append(t)
                pos.append(self.lens[i])
                self.lens[i] += 1
            q_lens.append(len(new))
        n, padded = len(new_tokens), self.pad_tokens or max(16, 1 << (len(toks) - 1).bit_length())
        pad, seq_pad = padded - len(toks), self.max_seqs - n
        tables = np.zeros((self.max_seqs, self.max_blocks), np.int32)
        for i, b in enumerate(self.blocks):
            tables[i, :len(b)] = b
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
            kv_lens=jnp.asarray(self.lens + [0] * seq_pad, jnp.int32),
            block_tables=jnp.asarray(tables),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), np.full(seq_pad, sum(q_lens))]),
                                  jnp.int32),
            num_seqs=jnp.asarray([n], jnp.int32))
        last = np.concatenate([np.cumsum(q_lens) - 1, np.zeros(seq_pad, int)])
        self.batch = (jnp.asarray(toks + [0] * pad, jnp.int32), jnp.asarray(pos + [0] * pad, jnp.int32), md,
                      jnp.asarray(last, jnp.int32))
        self.kv, logits = self.step(self.params, self.kv, self.batch)
        return np.asarray(logits)[:n]

    def collectives(self) -> list[str]:
        """Every collective in the compiled step, as 'op shape'."""
        text = self.step.lower(self.params, self.kv, self.batch).compile().as_text()
        found = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                           r"(?:-start)?\(", text)
        return [f"{op} {shape.split('{')[0]}" for shape, op in found]


def greedy(cfg: ModelConfig, mesh, params, prompts: list[list[int]], num_steps: int):
    """Greedy tokens [seq, 1 + steps], logits [seq, 1 + steps, vocab], and the step's collectives."""
    driver = PagedDriver(cfg, mesh, params)
    logits = [driver.run(prompts)]
    for _ in range(num_steps):
        logits.append(driver.run([[int(t)] for t in logits[-1].argmax(-1)]))
    logits = np.stack(logits, 1)
    return logits.argmax(-1), logits, driver.collectives()


def check_families() -> dict:
    """Each family at TP 1, 2, 4, 8: greedy tokens, max relative logit error vs TP 1, layout."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (11, 1, 7)]
    results = {}
    for name, extra in FAMILIES.items():
        cfg = ModelConfig(**{**BASE, **extra})
        host = random_params(cfg)
        ref_tokens = ref_logits = None
        for tp in TENSOR_PARALLEL_SIZES:
            mesh = parallel.make_mesh(tp)
            params = parallel.place_params(host, mesh, cfg, jnp.float32)
            tokens, logits, collectives = greedy(cfg, mesh, params, prompts, num_steps=4)
            if ref_tokens is None:
                ref_tokens, ref_logits = tokens, logits
            pool = (cfg.num_layers, cfg.num_kv_heads, 32, 4, cfg.head_dim)
            results[f"{name}/tp{tp}"] = dict(
                tokens_equal=bool((tokens == ref_tokens).all()),
                rel=float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
                kv_groups=parallel.partition_plan(cfg, tp).kv_groups,
                wq_shard=list(params["layers"]["wq"].sharding.shard_shape(params["layers"]["wq"].shape)),
                wk_shard=list(params["layers"]["wk"].sharding.shard_shape(params["layers"]["wk"].shape)),
                kv_shard=list(parallel.kv_cache_sharding(mesh, cfg).shard_shape(pool)),
                collectives=collectives)
    return results


def check_layout() -> dict:
    """Meshes, loading straight into shards, and the summary, on 8 devices."""
    out: dict = {}
    mesh = parallel.make_mesh(2, data_parallel_size=2)
    out["dp_mesh"] = dict(shape=dict(mesh.shape), replicas=[[d.id for d in m.devices.flat]
                                                            for m in parallel.replica_meshes(mesh)])
    for tp in (3, 16):
        try:
            parallel.make_mesh(tp)
            out[f"tp{tp}_error"] = None
        except ValueError as e:
            out[f"tp{tp}_error"] = str(e)
    # Loading: every device receives only its slice; the callback never reads a whole sharded leaf.
    cfg = ModelConfig(**{**BASE, **FAMILIES["qwen2_bias_tied"]})
    host = random_params(cfg)
    mesh = parallel.make_mesh(4)
    place = parallel.place_fn(mesh, cfg)
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(host)[0]:
        name = "/".join(k.key for k in path)
        arr = place(name, x, jnp.float32)
        shard_shapes = {tuple(s.data.shape) for s in arr.addressable_shards}
        leaves[name] = dict(full=list(x.shape), shards=[list(s) for s in shard_shapes],
                            devices=len(arr.addressable_shards), equal=bool(np.array_equal(np.asarray(arr), x)),
                            spec=str(arr.sharding.spec))
    out["placed"] = leaves
    sharded = parallel.shard_params(jax.tree.map(jnp.asarray, host), mesh, cfg)
    out["shard_params_matches"] = all(
        a.sharding == b.sharding for a, b in zip(jax.tree.leaves(sharded),
                                                 jax.tree.leaves(parallel.place_params(host, mesh, cfg,
                                                                                      jnp.float32))))
    kv = parallel.make_sharded_kv_cache(mesh, cfg, 32, 4, jnp.float32)
    out["summary"] = parallel.sharding_summary(mesh, cfg, sharded, kv)
    grouped = ModelConfig(**{**BASE, **FAMILIES["llama_kv_fewer"]})
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), llama.param_shapes(grouped),
                          is_leaf=lambda x: isinstance(x, tuple))
    out["summary_grouped"] = parallel.sharding_summary(mesh, grouped, shapes)
    return out


def write_hf_dir(path, cfg: ModelConfig, host: dict) -> None:
    """`host` params as an HF-format directory (config.json + model.safetensors, transformers' names)."""
    from safetensors.numpy import save_file

    from jaxserve.weights.assemble import LAYER_TENSORS

    tensors = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["final_norm"]}
    if "lm_head" in host:
        tensors["lm_head.weight"] = host["lm_head"].T
    for leaf, stacked in host["layers"].items():
        name, transpose = LAYER_TENSORS[leaf]
        for i, x in enumerate(stacked):
            tensors[f"model.layers.{i}.{name}"] = x.T if transpose else x
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, f"{path}/model.safetensors")
    hf = dict(architectures=[cfg.architecture], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
              tie_word_embeddings=cfg.tie_word_embeddings)
    with open(f"{path}/config.json", "w") as f:
        json.dump(hf, f)


def check_loading() -> dict:
    """load_model(dir, mesh=4 devices) with parallel.place_fn and jax.make_array_from_callback
    instrumented: per leaf, what each device's callback returned, which whole-leaf single-device
    arrays were alive meanwhile, and where the loaded leaf's bytes ended up."""
    import tempfile

    from jaxserve.weights.loader import load_model

    # Untied, so the vocabulary-split lm_head is loaded too; 2 kv heads < 4: replicated groups.
    cfg = ModelConfig(**{**BASE, "num_kv_heads": 2, "vocab_size": 512})
    host = random_params(cfg, seed=3)
    mesh = parallel.make_mesh(4)
    calls: dict[str, list[dict]] = {}  # leaf path -> one entry per callback
    current: list[str] = []
    real_place_fn, real_from_callback = parallel.place_fn, jax.make_array_from_callback

    def place_fn(mesh, cfg):
        place = real_place_fn(mesh, cfg)

        def tagged(path, host_array, dtype):
            current[:] = [path]
            return place(path, host_array, dtype)

        return tagged

    def from_callback(shape, sharding, callback, *args, **kwargs):
        log = calls.setdefault(current[0], [])
        shape = tuple(shape)

        def cb(index):
            out = callback(index)
            # A whole leaf on one device now would be a full copy made before splitting.
            whole = [d.id for a in jax.live_arrays() if a.shape == shape and len(a.sharding.device_set) == 1
                     for d in a.sharding.device_set]
            log.append(dict(returned=list(np.shape(out)), expected=list(sharding.shard_shape(shape)),
                            is_numpy=isinstance(out, np.ndarray), whole_on_device=whole))
            return out

        return real_from_callback(shape, sharding, cb, *args, **kwargs)

    import jaxserve.weights.loader as loader  # it holds its own reference to place_fn

    parallel.place_fn, loader.place_fn, jax.make_array_from_callback = place_fn, place_fn, from_callback
    try:
        with tempfile.TemporaryDirectory() as d:
            write_hf_dir(d, cfg, host)
            model = load_model(d, "float32", progress=False, mesh=mesh)
    finally:
        parallel.place_fn, loader.place_fn, jax.make_array_from_callback = (real_place_fn, real_place_fn,
                                                                            real_from_callback)
    leaves = {}
    flat_host = {"/".join(k.key for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(host)[0]}
    for path, x in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        name = "/".join(k.key for k in path)
        per_device: dict[int, int] = {}
        for s in x.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
        leaves[name] = dict(shape=list(x.shape), nbytes=int(x.nbytes), spec=str(x.sharding.spec),
                            per_device_bytes=per_device, equal=bool(np.array_equal(np.asarray(x), flat_host[name])),
                            callbacks=calls.get(name, []))
    return dict(leaves=leaves, mesh_devices=[d.id for d in mesh.devices.flat],
                host_read_device=jax.local_devices(backend="cpu")[0].id)


def check_default_model(ref_path: str) -> dict:
    """The default model at TP 2, teacher-forced on the transformers greedy tokens."""
    from jaxserve.weights.loader import load_model

    ref = json.loads(open(ref_path).read())  # [{"prompt_ids", "tokens", "margins"}]
    model = load_model(None, "float32", progress=False)
    mesh = parallel.make_mesh(2)
    params = parallel.shard_params(model.params, mesh, model.config)
    driver = PagedDriver(model.config, mesh, params, block_size=16, num_blocks=64, max_seqs=8, pad_tokens=None)
    steps = [driver.run([r["prompt_ids"] for r in ref])]
    for j in range(len(ref[0]["tokens"]) - 1):
        steps.append(driver.run([[r["tokens"][j]] for r in ref]))
    ours = np.stack(steps, 1).argmax(-1)  # [seq, steps]
    mismatches = [(i, j, int(ours[i, j]), t, r["margins"][j]) for i, r in enumerate(ref)
                  for j, t in enumerate(r["tokens"]) if ours[i, j] != t]
    return dict(num_tokens=int(ours.size), mismatches=mismatches,
                summary=parallel.sharding_summary(mesh, model.config, params, driver.kv))


def main(argv: list[str]) -> None:
    checks = {"families": check_families, "layout": check_layout, "default_model": check_default_model,
              "loading": check_loading}
    for what in argv[0].split(","):
        t0 = time.time()
        out = checks[what](*argv[1:]) if what == "default_model" else checks[what]()
        print(json.dumps({"check": what, "num_devices": jax.device_count(), "seconds": time.time() - t0,
                          "result": out}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
