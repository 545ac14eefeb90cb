"""Weights in and out of a live engine, in process (issue 48: RL rollouts inside a JAX trainer).

    engine.get_weights()            {HF name: jax.Array}, unfused, HF's layout (weights/hf_names.py)
    engine.engine_params()          the served param tree itself (what models' forward takes)
    engine.update_weights(w, version=None)     w: such a dict (any subset) or engine_params()' tree
    engine.update_weights_from_disk(path, version=None)   an HF safetensors dir or a convert checkpoint
    engine.reset_prefix_cache()

An update is validated whole before anything is applied (an unknown name, a wrong shape, a
non-float dtype, a NaN or inf: ValueError naming the parameter, the old weights kept): the new
leaves are built beside the old ones (peak memory: the old weights plus the leaves updated), then
swapped in at a step boundary. Each new leaf lands with the old leaf's sharding, dtype and shape,
so every compiled step program still applies: an update compiles nothing the steps use. A numpy
leaf given whole is assembled on the host and placed with one device_put (each device gets its
slice); jax arrays are moved onto the engine's mesh slice by slice and assembled there by one small
program per leaf (compiled on first use, cached with the engine). A tree leaf that already has its
sharding and dtype is adopted as it is, with no copy. `--quantization int8` / `fp8` engines quantize
what they receive (quantization/quantize.py); int8 smooths every layer together, so it takes every
parameter at once. The prefix cache is emptied, and the requests running at the update (they go
on, on the new weights) never offer their blocks to it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.models.expert_weights import BF16_BITS, LAYER_VIEWS, with_layer_views
from jaxserve.parallel.jit import fresh_jit
from jaxserve.quantization.qweight import QuantizedWeight
from jaxserve.quantization.quantize import LINEAR_LEAVES, calibration_ids, quantize_params, quantize_weight
from jaxserve.weights import hf_names, hf_names_vl
from jaxserve.weights.hf_names import FUSED, TOP_LEVEL, Given

# what the runner adds to the served params besides the weights (LoRA slots and their owners,
# a MoE stack's per-layer views): kept as they are across an update
RUNNER_TOP = ("lora_owner",)
RUNNER_LAYERS = ("lora", LAYER_VIEWS)
# config fields a checkpoint may differ in and still be the same model
CONFIG_FREE = ("bos_token_id", "eos_token_ids")


class WeightSync:
    """LLMEngine's weights API (a mixin; the attributes are LLMEngine's)."""

    @property
    def weights_version(self) -> Any:
        """The `version` of the last update_weights (None before any)."""
        return self.__dict__.get("_weights_version")

    # ---- out ------------------------------------------------------------------------------------
    def engine_params(self) -> dict:
        """The served param tree (models/llama.py's layout: stacked layers, [in, out]), the arrays
        themselves: update_weights adopts a tree of the same structure and shardings with no copy."""
        self._check_weights_api()
        p = self.runner.params
        self._owns_weights = False  # handed out: shutdown drops them instead of deleting them
        return {**{k: v for k, v in p.items() if k not in RUNNER_TOP},
                "layers": {k: v for k, v in p["layers"].items() if k not in RUNNER_LAYERS}}

    def get_weights(self) -> dict[str, jax.Array]:
        """The served weights as {Hugging Face name: jax.Array}, unfused and in HF's layout ([out, in]
        Linear weights): the embedding and the final norm are the engine's own arrays, the rest one
        copy each (a layer's slice of a stack, transposed). Quantized int8 / fp8 engines give their
        weights dequantized (int8: SmoothQuant's scales folded in: the same function, other tensors)."""
        return self._to_hf(self.engine_params())

    def _to_hf(self, params: Mapping) -> dict[str, jax.Array]:
        cfg = self.model.config
        names = hf_names.name_map(cfg)
        out = {TOP_LEVEL[k][0]: params[k] for k in ("embed", "final_norm")}
        if "lm_head.weight" in names:  # untied (an int8 engine's lm_head of a tied model is embed's)
            out["lm_head.weight"] = self._program(("head",), lambda h: hf_names.float_layers(
                {"h": h}, cfg, self.model_dtype)["h"].T)(params["lm_head"])
        leaves = {p.leaf for t in names.values() for p in t.parts if p.index}
        layers = {k: v for k, v in params["layers"].items() if k in leaves or k in FUSED}
        out.update(self._program(("unstack",), lambda layers: hf_names.to_hf(
            hf_names.float_layers(layers, cfg, self.model_dtype), names))(layers))
        if "vision" in params:  # a vision-language model's tower (weights/hf_names_vl.py)
            out.update(hf_names_vl.to_hf(cfg.vision, params["vision"], self.model_dtype, self._program))
        return out

    # ---- in -------------------------------------------------------------------------------------
    def update_weights(self, weights: Mapping, *, version: Any = None) -> None:
        """Serve `weights` from the next step on: a {HF name: array} dict (any subset of the names;
        jax or numpy; any sharding; any float dtype) or engine_params()' tree. ValueError naming the
        parameter for anything wrong, and then nothing changes."""
        self._check_weights_api()
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights: expected a dict of Hugging Face names to arrays or engine_params()' "
                             f"tree, got {type(weights).__name__}")
        current = self.engine_params()
        tree = isinstance(weights.get("layers"), Mapping)
        if not tree and "vision" in current:  # the tower's names apart (weights/hf_names_vl.py)
            weights, tower = hf_names_vl.split(weights)
            current = {**current, "vision": hf_names_vl.updated(self.model.config.vision, current["vision"], tower)}
        new = self._adopt_tree(weights, current) if tree else self._from_names(weights, current)
        self._apply(new, version)

    def update_weights_from_disk(self, model_path: str | Path, version: Any = None) -> None:
        """update_weights from a directory: Hugging Face safetensors or a `jaxserve convert` checkpoint
        of the same architecture and config (ValueError saying what differs; old weights kept)."""
        from jaxserve.models.config import with_expert_parallel
        from jaxserve.models.longrope import for_max_model_len
        from jaxserve.weights.checkpoint import load_checkpoint_params
        from jaxserve.weights.safetensors_dir import tensor_reader
        from jaxserve.weights.source import describe_path

        self._check_weights_api()
        path = Path(model_path)
        if not path.is_dir():
            raise ValueError(f"model_path: {str(model_path)!r} is not a directory")
        try:
            source = describe_path(path, str(path))
        except (ValueError, OSError) as e:
            raise ValueError(f"model_path: {e}") from None
        if source.format not in ("hf", "checkpoint"):
            raise ValueError(f"model_path: {path} holds {source.format!r} weights; expected a Hugging Face "
                             "safetensors directory or a `jaxserve convert` checkpoint")
        if source.quantization is not None:
            raise ValueError(f"model_path: {path} is a {source.quantization} checkpoint; update_weights takes "
                             "float weights (the engine quantizes them itself under --quantization)")
        # as the engine made its own: the expert-parallel flag, LongRoPE's factor set for its max_model_len
        got = for_max_model_len(with_expert_parallel(source.config, self.args.enable_expert_parallel),
                                self.max_model_len)
        check_same_config(got, self.model.config, path)
        if source.format == "checkpoint":  # the float tree: adopted as it is, or by name into a quantized engine
            params = load_checkpoint_params(path, self.model_dtype)
            self.update_weights(self._to_hf(params) if self.args.quantization else params, version=version)
            return
        get, _ = tensor_reader(path)
        weights, names = {}, list(hf_names.name_map(self.model.config))
        if self.model.config.vision is not None:  # and the tower's, under either naming (weights/hf_names_vl.py)
            from jaxserve.models.qwen2_vl import tensor_getter

            get, names = tensor_getter(get), names + list(hf_names_vl.vision_names(self.model.config.vision))
        for name in names:
            try:
                weights[name] = np.asarray(get(name))  # on the host: placed slice by slice
            except KeyError:
                raise ValueError(f"model_path: {path} has no tensor {name!r}") from None
        self.update_weights(weights, version=version)

    def reset_prefix_cache(self) -> bool:
        """Forget every block of the prefix cache (vLLM's); True (it always can here)."""
        self._check_open()
        self.scheduler.kv.reset_prefix_cache()
        return True

    # ---- the two forms of an update ---------------------------------------------------------------
    def _from_names(self, weights: Mapping, current: dict) -> dict:
        cfg, dtype = self.model.config, self.model_dtype
        names = hf_names.name_map(cfg)
        given = hf_names.check_named(weights, names)
        quant = self._on_load_quantization()
        if quant == "int8" and len(weights) < len(names):
            missing = next(n for n in names if n not in weights)
            raise ValueError(f"{missing}: missing; an --quantization int8 engine smooths every layer together "
                             f"(SmoothQuant), so it takes every parameter at once ({len(names) - len(weights)} "
                             "missing)")
        shapes = hf_names.param_shapes(cfg)
        new_top, new_layers, flags = {}, {}, []
        for leaf, g in given.items():
            top = leaf in TOP_LEVEL
            old = current[leaf] if top else current["layers"].get(leaf)
            shape = tuple(shapes[leaf] if top else shapes["layers"][leaf])
            whole = g.covers(shape)
            if not whole and not isinstance(old, jax.Array):
                missing = next(n for n, t in names.items() if n not in weights and any(p.leaf == leaf for p in t.parts))
                why = ("a quantized engine requantizes it whole" if isinstance(old, QuantizedWeight) else
                       "the engine's weights were dropped by sleep(level=2)")
                raise ValueError(f"{missing}: missing; {why}, so give every parameter of layers/{leaf}")
            leaf_dtype = old.dtype if isinstance(old, jax.Array) and old.dtype == BF16_BITS else dtype
            arr, finite = self._assemble(g, None if whole else old, _float_target(old, current), shape, leaf_dtype)
            flags.append((g, finite))
            (new_top if top else new_layers)[leaf] = arr
        for (g, _), finite in zip(flags, jax.device_get([f for _, f in flags])):
            bad = np.flatnonzero(~np.asarray(finite))
            if bad.size:
                raise ValueError(f"{g.parts[bad[0]][0]}: non-finite values (NaN or inf)")
        new = {**current, **new_top, "layers": {**current["layers"], **new_layers}}
        if quant == "fp8":
            new["layers"] = {k: place_like(quantize_weight(v, "fp8"), current["layers"][k])
                             if k in new_layers and k in LINEAR_LEAVES else v for k, v in new["layers"].items()}
        elif quant == "int8":
            new = self._int8(new, current)
        return new

    def _assemble(self, g: Given, base, target, shape: tuple[int, ...], dtype) -> tuple:
        """One leaf's new array (on `target`; into `base` where the parts cover only some of it) and its
        finite flags per given part."""
        engine_devices = set(target.device_set)
        values = [a if isinstance(a, np.ndarray) or set(a.devices()) <= engine_devices else np.asarray(a)
                  for _, _, a in g.parts]
        if base is None and all(isinstance(v, np.ndarray) for v in values):
            host, finite = hf_names.host_leaf(g, shape, dtype)
            return jax.device_put(host, target), finite
        parts = tuple(p for _, p, _ in g.parts)
        placed = []
        for v, p in zip(values, parts):
            part_target = _part_sharding(target, len(shape), p)
            keep = isinstance(v, jax.Array) and v.sharding == part_target
            placed.append(v if keep else jax.device_put(v, part_target))
        program = self._program(("assemble", target), hf_names.assemble_fn, out_shardings=(target, None),
                                static_argnames=("parts", "shape", "dtype"))
        return program(base, tuple(placed), parts=parts, shape=shape, dtype=jnp.dtype(dtype))

    def _int8(self, new: dict, current: dict) -> dict:
        """SmoothQuant over the whole float tree, then each leaf placed as the served one."""
        floats = {k: v for k, v in new["layers"].items() if k not in FUSED}
        if "lm_head" in new and isinstance(new["lm_head"], QuantizedWeight):  # tied: derived from embed
            new = {k: v for k, v in new.items() if k != "lm_head"}
        ids = calibration_ids(self.tokenizer, self.model.config.vocab_size)
        quantized = quantize_params({**new, "layers": floats}, self.model.config, "int8", ids)
        if jax.tree.structure(quantized) != jax.tree.structure(current):
            raise ValueError("update_weights: the int8 engine's tree and the requantized one differ "
                             f"({sorted(quantized['layers'])} vs {sorted(current['layers'])})")
        return jax.tree.map(place_like, quantized, current, is_leaf=lambda x: isinstance(x, QuantizedWeight))

    def _adopt_tree(self, weights: Mapping, current: dict) -> dict:
        """engine_params()' structure: each leaf checked, then adopted (same sharding and dtype: no
        copy) or cast and placed on the served leaf's sharding."""
        new_flat, treedef = jax.tree_util.tree_flatten_with_path(dict(weights))
        old_flat, old_def = jax.tree_util.tree_flatten_with_path(current)
        if treedef != old_def:
            want, got = {jax.tree_util.keystr(p) for p, _ in old_flat}, {jax.tree_util.keystr(p) for p, _ in new_flat}
            diff = sorted(want - got)[:1] or sorted(got - want)[:1] or ["(the leaf types)"]
            raise ValueError(f"weights{diff[0]}: not engine_params()' structure "
                             f"({'missing' if want - got else 'unexpected' if got - want else 'differs'})")
        floats, out = [], []
        for (path, x), (_, old) in zip(new_flat, old_flat):
            name = "weights" + jax.tree_util.keystr(path)
            if not isinstance(x, (np.ndarray, jax.Array)):
                raise ValueError(f"{name}: expected a jax or numpy array, got {type(x).__name__}")
            if tuple(x.shape) != tuple(old.shape):
                raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(old.shape)}")
            is_float = jnp.issubdtype(old.dtype, jnp.floating)
            if x.dtype != old.dtype and not (is_float and jnp.issubdtype(x.dtype, jnp.floating)):
                raise ValueError(f"{name}: dtype {x.dtype}, expected {old.dtype}")
            out.append(adopt(x, old))
            if is_float:
                floats.append((name, path, len(out) - 1))
        finite = self._program(("finite",), lambda xs: [jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
                                                        if x.ndim > 1 else jnp.all(jnp.isfinite(x))[None]
                                                        for x in xs])([out[i] for _, _, i in floats])
        for (name, path, _), ok in zip(floats, jax.device_get(finite)):
            bad = np.flatnonzero(~np.asarray(ok))
            if bad.size:
                raise ValueError(f"{self._tree_name(name, path, int(bad[0]))}: non-finite values (NaN or inf)")
        return jax.tree_util.tree_unflatten(old_def, out)

    def _tree_name(self, name: str, path: tuple, index: int) -> str:
        """A tree leaf's error name: its HF name too where it has one (weights['layers']['wq'], layer 3)."""
        keys = [getattr(k, "key", None) for k in path]
        leaf, at = (keys[1], (index,)) if keys[0] == "layers" and len(keys) == 2 else (keys[0], ())
        try:
            hf = hf_names.leaf_names(hf_names.name_map(self.model.config)).get((leaf, at))
        except ValueError:
            hf = None
        where = f"{name}[{index}]" if at else name
        return f"{hf} ({where})" if hf else where

    # ---- applying ---------------------------------------------------------------------------------
    def _apply(self, new: dict, version: Any) -> None:
        """Swap the new tree in (between steps: the caller's thread is the engine's), keeping what the
        runner adds to it; empty the prefix cache."""
        old = self.runner.params
        layers = {**new["layers"], **{k: v for k, v in old["layers"].items() if k == "lora"}}
        if LAYER_VIEWS in old["layers"]:
            layers = with_layer_views(layers)
        self.runner.params = {**new, **{k: old[k] for k in RUNNER_TOP if k in old}, "layers": layers}
        self.model = dataclasses.replace(self.model, params=new)
        self._owns_weights = False  # the arrays may be the caller's (adopted)
        self.scheduler.kv.reset_prefix_cache(weights_changed=True)
        if getattr(self.runner, "mm", None) is not None:  # images' rows from the old tower
            self.runner.mm.clear_cache()
        self._weights_version = version

    def _check_weights_api(self) -> None:
        self._check_open()
        if self.pooling_info is not None:
            raise ValueError("runner: the weights API serves generation models; this engine runs runner='pooling'")
        if self.pipeline is not None:
            raise ValueError("pipeline_parallel_size: update_weights and get_weights do not cover pipeline "
                             "stages yet; use tensor_parallel_size")
        if self.runner.multi_process:
            raise ValueError("num_hosts: the weights API runs in one process; this engine spans several")

    def _on_load_quantization(self) -> str | None:
        if self.model.quantization is not None:
            raise ValueError(f"update_weights: the engine serves a {self.model.quantization} checkpoint; updates "
                             "take float weights into a float, --quantization int8 or fp8 engine")
        return self.args.quantization

    def _program(self, key: tuple, fn: Callable, **jit_kwargs) -> Callable:
        """A jitted program owned by this engine (freed with it), compiled once per input layout."""
        programs = self.__dict__.setdefault("_weight_programs", {})
        if key not in programs:
            programs[key] = fresh_jit(fn, **jit_kwargs)
        return programs[key]


def check_same_config(got, want, path: Path) -> None:
    """ValueError naming the first config field (besides bos/eos ids) in which `got` differs."""
    for f in dataclasses.fields(want):
        if f.name not in CONFIG_FREE and getattr(got, f.name) != getattr(want, f.name):
            raise ValueError(f"model_path: {path} is not the served model's config: {f.name} is "
                             f"{getattr(got, f.name)!r}, the engine serves {getattr(want, f.name)!r}")


def adopt(x, old: jax.Array) -> jax.Array:
    """`x` as the engine holds `old`: itself when it already is (no copy), else cast and placed."""
    if isinstance(x, jax.Array) and x.dtype == old.dtype and x.committed and x.sharding == old.sharding:
        return x
    if isinstance(x, np.ndarray):
        return jax.device_put(x.astype(np.dtype(old.dtype), copy=False), old.sharding)
    return jax.device_put(x.astype(old.dtype) if x.dtype != old.dtype else x, old.sharding)


def place_like(new, old):
    """A requantized (or float) leaf placed as the served one: each array on its sharding, a
    QuantizedWeight's static fields (its tensor-parallel split) kept."""
    if isinstance(old, QuantizedWeight):
        fields = {f: jax.device_put(getattr(new, f), getattr(old, f).sharding)
                  for f in ("values", "scales") if getattr(new, f) is not None}
        return dataclasses.replace(old, **fields)
    return jax.device_put(new, old.sharding)


def _float_target(old, current: dict):
    """Where a leaf's float form is assembled: the served leaf's sharding (a quantized one's values'),
    or, for an int8 engine's unfused leaves, the fused leaf's."""
    if old is None:
        old = current["layers"]["wqkv"]
    return (old.values if isinstance(old, QuantizedWeight) else old).sharding


def _part_sharding(target, ndim: int, part: hf_names.Part):
    """The sharding of one part's HF array placed for a leaf of `ndim` axes on `target`: the leaf's spec
    without the part's index axes (last two swapped for a transposed weight), so each device is sent only
    the slice it keeps; a cut (fused, reshaped) tensor replicated, as its slices do not line up."""
    if not isinstance(target, NamedSharding):
        return target
    if not part.cut.whole:
        return NamedSharding(target.mesh, PartitionSpec())
    spec = (tuple(target.spec) + (None,) * ndim)[:ndim][len(part.index):]
    if part.cut.transpose:
        spec = spec[:-2] + spec[-2:][::-1]
    return NamedSharding(target.mesh, PartitionSpec(*spec))


class AsyncWeightSync:
    """AsyncLLM's weights API (`await engine.update_weights(...)`): each call runs on the engine thread
    between two steps (AsyncLLM._control, engine/sleep.py), so no step sees half an update."""

    async def update_weights(self, weights: Mapping, *, version: Any = None) -> None:
        await self._control(lambda e: e.update_weights(weights, version=version))

    async def update_weights_from_disk(self, model_path: str | Path, version: Any = None) -> None:
        await self._control(lambda e: e.update_weights_from_disk(model_path, version=version))

    async def reset_prefix_cache(self) -> bool:
        return await self._control(lambda e: e.reset_prefix_cache())

    async def get_weights(self) -> dict[str, jax.Array]:
        return await self._control(lambda e: e.get_weights())

    async def engine_params(self) -> dict:
        return await self._control(lambda e: e.engine_params())


class DataParallelWeightSync:
    """The replicas' front: every replica takes the same update, each on its engine thread (they serve
    the same model, so what one refuses the others refuse too)."""

    async def update_weights(self, weights: Mapping, *, version: Any = None) -> None:
        await asyncio.gather(*(r.update_weights(weights, version=version) for r in self.replicas))

    async def update_weights_from_disk(self, model_path: str | Path, version: Any = None) -> None:
        await asyncio.gather(*(r.update_weights_from_disk(model_path, version=version) for r in self.replicas))

    async def reset_prefix_cache(self) -> bool:
        return all(await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas)))
