"""One MoE layer (jaxserve/models/moe.py) against two bounds measured in the same run, on XLA.

Shape: Qwen3-30B-A3B's proportions scaled down to fit a 2-core CPU: 128 experts, top-8,
expert width I = 0.375 x hidden (768 / 2048), hidden 512, float32. Token counts 1, 4, 16, 32, 64, 256.

    moe           moe.moe(x, router, experts): the engine's path choice (gather while T*k <= 2E with
                  the layer's own arrays, as here, else batched)
    batched       the batched path forced (every expert's first C rows in three batched dots; packed
                  stacks: the per-expert loop they take instead)
    gather        the gather path forced (a loop over the T*k rows, each reading its expert)
    ragged_dot    jax.lax.ragged_dot on the sorted rows (the candidate not chosen)
    (a) dense     a dense SwiGLU of the active width (top-k x I) at T rows
    (b) touched   reading every touched expert's weights once (a dense SwiGLU of width U x I at
                  1 row, U = experts the batch touches) plus the active FLOPs (a dense SwiGLU of
                  width k x I at T rows, its time), summed

    .venv/bin/python scripts/bench_moe.py [--hidden 512] [--repeats 20] [--experts bf16|fp8_block|mxfp4]
    .venv/bin/python scripts/bench_moe.py --forms     # moe.moe over float32 / bfloat16 / fp8_block / mxfp4 stacks
    .venv/bin/python scripts/bench_moe.py --scan 4    # as the engine runs it: in a scan over 4 layers
    .venv/bin/python scripts/bench_moe.py --scan 4 --experts bf16 --experts-used 48   # a skewed router

--scan L runs the moe paths inside a `lax.scan` over L layers of their own weights, as the
engine's layer scan does (llama.run_layers: the experts handed over as expert_weights.LayerStack,
read at (layer, expert), with each layer's stacks as arrays of their own for the batched dots, as
the runner makes them on one CPU device: expert_weights.layer_views), and the bounds over L
layers of their own arrays, each read once (an unrolled loop: a scan's slices would be copied
first), and reports milliseconds per layer. The stacks then come from memory, not the cache, as
in a served model.

Without --scan the layer goes to moe.moe as the engine's scan hands it over (as_engine_layer: a
one-layer LayerStack with its own arrays); ragged_dot takes the plain [E, N, K] stacks.

--experts packs the expert stacks (block-wise fp8 with 64 x 64 blocks, or MXFP4) as a quantized
checkpoint loads them; the paths then unpack the experts they touch (ragged_dot is skipped: it
takes float stacks only). --experts bf16: the values rounded to bfloat16 and kept as their bits,
as the CPU default keeps a bfloat16 checkpoint's experts (expert_weights.bf16_bits), and `moe`
given the engine's step dots (bfloat16 from 64 tokens on a CPU with bfloat16 dots: the batched
dots then read the layer's own arrays as bfloat16; below, past the gather path, the loop); the
forced batched path always takes the bfloat16 dots. The bounds stay float32.

Targets (issue 38): moe within 1.5x of (a) at 1 and 4 tokens, within 2x of (b) at 64+.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import moe

NUM_EXPERTS, TOP_K, WIDTH = 128, 8, 0.375
TOKENS = (1, 4, 16, 32, 64, 256)


def timeit(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` (compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def dense_swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def ragged(x, router, ex: moe.Experts):
    """The expert block through jax.lax.ragged_dot (sorted rows, group sizes)."""
    ids, weights = moe.route(x, router)
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=ex.num_experts).astype(jnp.int32)
    lhs = x[order // k]
    kn = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731  ragged_dot takes [E, K, N]
    h = jax.nn.silu(jax.lax.ragged_dot(lhs, kn(ex.w_gate), sizes)) * jax.lax.ragged_dot(lhs, kn(ex.w_up), sizes)
    y_sorted = jax.lax.ragged_dot(h, kn(ex.w_down), sizes)
    y = moe.unsort(y_sorted, order).reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", y, weights)


def forced(path: str):
    """moe.moe with one path forced: "gather", "looped" (the per-expert loop), or "batched" (packed
    stacks: the loop they take instead, as expert_swiglu)."""
    def run(x, router, ex):
        ids, weights = moe.route(x, router)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        lhs = x[order // k]
        if path == "gather":
            y_sorted = moe._gathered_swiglu(lhs, flat[order], ex)
        else:
            sizes = jnp.bincount(flat, length=ex.num_experts)
            looped = path == "looped" or moe.is_packed(ex.w_gate)
            y_sorted = (moe._looped_swiglu if looped else moe._batched_swiglu)(lhs, sizes, ex)
        y = moe.unsort(y_sorted, order).reshape(t, k, -1)
        return jnp.einsum("tkh,tk->th", y, weights)
    return run


def pack(ex: moe.Experts, form: str) -> moe.Experts:
    """The float stacks [E, N, K] in `form`, as a checkpoint of that format loads them (bf16: the
    values rounded to bfloat16, stored as their bits, as the CPU default stores a bfloat16
    checkpoint's experts)."""
    if form == "float":
        return ex
    if form == "bf16":
        from jaxserve.models.expert_weights import bf16_bits
        return jax.tree.map(lambda w: bf16_bits(w.astype(jnp.bfloat16).astype(jnp.float32)), ex)
    from jaxserve.quantization.mxfp4 import Mxfp4Weight
    from jaxserve.quantization.qweight import QuantizedWeight

    def one(w):
        w = np.asarray(w)
        e, n, k = w.shape
        if form == "fp8_block":
            b = 64  # 128 in the hub format; 64 divides this scaled-down width (192)
            scales = np.abs(w.reshape(e, n // b, b, k // b, b)).max(axis=(2, 4)) / 448.0  # [E, N/b, K/b]
            q = w / np.repeat(np.repeat(scales, b, 1), b, 2)
            return QuantizedWeight(jnp.asarray(q).astype(jnp.float8_e4m3fn), jnp.asarray(scales),
                                   scheme="fp8_block", group_size=b, block_cols=b)
        rng = np.random.default_rng(1)  # MXFP4: random codes (speed only; values do not matter here)
        return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)),
                           jnp.full((e, n, k // 32), 120, jnp.uint8))

    return moe.Experts(one(ex.w_gate), one(ex.w_up), one(ex.w_down))


def as_engine_layer(ex: moe.Experts) -> moe.Experts:
    """One layer's stacks as the engine's layer scan hands them over: a LayerStack of a one-layer
    stack, with its layer's own arrays (expert_weights.layer_views: float stacks on one CPU device)."""
    from jaxserve.models.expert_weights import LayerStack, layer_views

    def one(w):
        stack = jax.tree.map(lambda a: a[None], w)
        return LayerStack(stack, jnp.int32(0), layer_views(stack) if isinstance(stack, jax.Array) else None)

    return moe.Experts(one(ex.w_gate), one(ex.w_up), one(ex.w_down))


def layer(hidden: int, seed: int = 0):
    """(experts [E, out, in] float32, router, a weight maker) of one scaled-down layer."""
    i = int(hidden * WIDTH)
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[-1]))  # noqa: E731  [out, in]
    ex = moe.Experts(w(NUM_EXPERTS, i, hidden), w(NUM_EXPERTS, i, hidden), w(NUM_EXPERTS, hidden, i))
    return ex, moe.Router(w(NUM_EXPERTS, hidden).T, None, TOP_K, True), w


def step_dots(form: str, tokens: int):
    """The dots dtype the engine's step of `tokens` tokens hands the layer with `form` experts (bf16:
    the CPU default's bfloat16 dots from sizing.CPU_BF16_DOTS_FROM tokens, where the CPU has them);
    None (float32) for the other forms, as the tables before them were measured."""
    from jaxserve.worker import sizing
    start = sizing.default_bf16_dots_from(True)  # 0: this CPU has no bfloat16 dots
    return jnp.bfloat16 if form == "bf16" and start and tokens >= start else None


def scan_table(hidden: int, num_layers: int, repeats: int, tokens: list[int], form: str = "float",
               used: int = NUM_EXPERTS) -> None:
    """--scan: the moe paths and the bounds, each in a scan over `num_layers` layers (ms per layer);
    `used` < NUM_EXPERTS: a router biased to the first `used` experts (a skewed batch)."""
    from jaxserve.models.expert_weights import LayerStack, layer_views

    i = int(hidden * WIDTH)
    made = [layer(hidden, seed=s) for s in range(num_layers)]
    w = made[0][2]
    stacks = pack(jax.tree.map(lambda *a: jnp.stack(a), *[ex for ex, _, _ in made]), form)  # [L, E, N, K] each
    stacks = (stacks, jax.tree.map(layer_views, stacks))  # the stacks and their layers' own arrays
    routers = jnp.stack([r.weight for _, r, _ in made])  # [L, H, E]
    bias = None if used >= NUM_EXPERTS else jnp.where(jnp.arange(NUM_EXPERTS) < used, 0.0, -1e4)

    def scanned(path: str, dots=None):
        def run(x, stacks, routers):
            def body(h, xs):
                rw, li = xs
                whole, views = stacks
                ex = moe.Experts(*(LayerStack(s, li, v) for s, v in zip(
                    (whole.w_gate, whole.w_up, whole.w_down), (views.w_gate, views.w_up, views.w_down))))
                router = moe.Router(rw, bias, TOP_K, True)
                if path == "moe":
                    return h + moe.moe(h, router, ex, dots), None
                return h + forced(path)(h, router, ex), None
            return jax.lax.scan(body, x, (routers, jnp.arange(num_layers)))[0]
        return jax.jit(run)

    def dense_layers(x, layers):  # the bounds read each layer's weights once: its own arrays, unrolled
        for ws in layers:
            x = x + dense_swiglu(x, *ws)
        return x

    dense = jax.jit(dense_layers)
    stackw = lambda *shape: [w(*shape).T for _ in range(num_layers)]  # noqa: E731  L arrays [in, out]
    active = (stackw(TOP_K * i, hidden), stackw(TOP_K * i, hidden), stackw(hidden, TOP_K * i))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; hidden {hidden}, {NUM_EXPERTS} experts of "
          f"width {i}, top-{TOP_K}, experts {form}; a scan over {num_layers} layers, ms per layer, median of {repeats}")
    print("| tokens | touched | moe ms | (a) ms | moe/(a) | (b) ms | moe/(b) | looped ms | gather ms | batched ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for t in tokens:
        fns = {p: scanned(p, step_dots(form, t)) for p in ("moe", "looped", "gather", "batched")}
        x = jnp.asarray(rng.standard_normal((t, hidden), np.float32))
        ids, _ = moe.route(x, moe.Router(made[0][1].weight, bias, TOP_K, True))
        touched = int(np.unique(np.asarray(ids)).size)
        per = {p: timeit(f, x, stacks, routers, repeats=repeats) / num_layers
               for p, f in fns.items() if not (p == "gather" and t > 256)}
        a = timeit(dense, x, list(zip(*active)), repeats=repeats) / num_layers
        wide = (stackw(touched * i, hidden), stackw(touched * i, hidden), stackw(hidden, touched * i))
        b = timeit(dense, x[:1], list(zip(*wide)), repeats=repeats) / num_layers + a
        del wide
        ms = lambda v: f"{v * 1e3:.3f}" if v is not None else "-"  # noqa: E731
        print(f"| {t} | {touched} | {ms(per['moe'])} | {ms(a)} | {per['moe'] / a:.2f} | {ms(b)} | "
              f"{per['moe'] / b:.2f} | {ms(per['looped'])} | {ms(per.get('gather'))} | {ms(per['batched'])} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--experts", default="float", choices=["float", "bf16", "fp8_block", "mxfp4"])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--scan", type=int, default=0, metavar="L", help="in a scan over L layers (see above)")
    p.add_argument("--experts-used", type=int, default=NUM_EXPERTS, metavar="U",
                   help="--scan: route every token among the first U experts only (a skewed router)")
    args = p.parse_args()
    if args.scan:
        return scan_table(args.hidden, args.scan, args.repeats, args.tokens, args.experts, args.experts_used)
    h, i = args.hidden, int(args.hidden * WIDTH)
    ex, router, w = layer(h)
    ex = pack(ex, args.experts)
    engine = as_engine_layer(ex)
    active = (w(TOP_K * i, h).T, w(TOP_K * i, h).T, w(h, TOP_K * i).T)  # [in, out]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; hidden {h}, {NUM_EXPERTS} experts of "
          f"width {i}, top-{TOP_K}, float32, experts {args.experts}; median of {args.repeats}")
    print("| tokens | touched | moe ms | path | (a) dense ms | moe/(a) | (b) ms | moe/(b) | batched ms | "
          "gather ms | ragged_dot ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fns = {"moe": None, "batched": jax.jit(forced("batched")), "gather": jax.jit(forced("gather"))}
    if args.experts == "float":
        fns["ragged"] = jax.jit(ragged)
    dense = jax.jit(dense_swiglu)
    rng = np.random.default_rng(1)
    for t in args.tokens:
        x = jnp.asarray(rng.standard_normal((t, h), np.float32))
        ids, _ = moe.route(x, router)
        touched = int(np.unique(np.asarray(ids)).size)
        dots = step_dots(args.experts, t)
        fns["moe"] = jax.jit(functools.partial(moe.moe, dots=dots))
        times = {name: timeit(f, x, router, ex if name == "ragged" else engine, repeats=args.repeats)
                 for name, f in fns.items() if not (name == "gather" and t > 64)}
        a = timeit(dense, x, *active, repeats=args.repeats)
        wide = (w(touched * i, h).T, w(touched * i, h).T, w(h, touched * i).T)
        b = timeit(dense, x[:1], *wide, repeats=args.repeats) + a
        looped = moe.is_packed(ex.w_gate) or (args.experts == "bf16" and dots is None)
        path = "gather" if t * TOP_K <= moe._gather_max_rows(engine) else "loop" if looped else "batched"
        ms = lambda s: f"{s * 1e3:.3f}" if s is not None else "-"  # noqa: E731
        print(f"| {t} | {touched} | {ms(times['moe'])} | {path} | {ms(a)} | {times['moe'] / a:.2f} | {ms(b)} | "
              f"{times['moe'] / b:.2f} | {ms(times['batched'])} | {ms(times.get('gather'))} | "
              f"{ms(times.get('ragged'))} |", flush=True)


def forms_table(hidden: int, repeats: int) -> None:
    """moe.moe with the same routing over float32, bfloat16 (with bfloat16 activations, as
    `--dtype bfloat16` runs it), block-wise fp8 and MXFP4 expert stacks, timed side by side in one
    process (--forms)."""
    ex, router, _ = layer(hidden)
    forms = {f: pack(ex, f) for f in ("float", "fp8_block", "mxfp4")}
    forms["bfloat16"] = moe.Experts(*(w.astype(jnp.bfloat16) for w in (ex.w_gate, ex.w_up, ex.w_down)))
    run = jax.jit(moe.moe)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; hidden {hidden}, {NUM_EXPERTS} experts of "
          f"width {int(hidden * WIDTH)}, top-{TOP_K}, x float32 (bfloat16 with the bfloat16 stacks); moe.moe ms, "
          f"median of {repeats}")
    print("| tokens | float32 | bfloat16 | bf16/float | fp8_block | fp8/float | mxfp4 | mxfp4/float |\n"
          "|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for t in TOKENS:
        x = jnp.asarray(rng.standard_normal((t, hidden), np.float32))
        ms = {f: timeit(run, x.astype(jnp.bfloat16) if f == "bfloat16" else x, router, e, repeats=repeats) * 1e3
              for f, e in forms.items()}
        ratio = lambda f: f"{ms[f]:.3f} | {ms[f] / ms['float']:.2f}"  # noqa: E731
        print(f"| {t} | {ms['float']:.3f} | {ratio('bfloat16')} | {ratio('fp8_block')} | {ratio('mxfp4')} |",
              flush=True)


if __name__ == "__main__":
    if "--forms" in sys.argv:
        sys.argv.remove("--forms")
        forms_table(512, 10)
    else:
        main()
