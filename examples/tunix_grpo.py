"""Tunix's own GRPO learner with jaxserve as its rollout engine, in one process.

Tunix (google-tunix==0.1.7) trains its own nnx Llama3 actor with its own GRPOLearner and RLCluster;
jaxserve samples for it through `jaxserve.rl.tunix_rollout.JaxserveRollout`, handed to Tunix as
`ClusterConfig(rollout_engine=functools.partial(JaxserveRollout, llm=llm))`. After each trainer step
Tunix calls the adapter's `update_params` (its `sync_weights`), which maps the actor's nnx state to
Hugging Face names and calls `LLM.update_weights`. At the end the engine's sampled logprobs are
checked against Tunix's own forward of the trained actor (float32, 1e-4): the engine serves exactly
the weights Tunix trained.

The actor is a tiny random Llama3 at Tunix's model class (2 layers, 64 wide, a 256-word vocabulary),
saved as a Hugging Face directory for the engine. Not the default SmolLM2-135M: Tunix 0.1.7's Llama3
rotates with rope_theta 1e6 whatever its config says (SmolLM2 uses 1e5), so its forward of SmolLM2
is not SmolLM2 and the final check could not hold. The toy reward: the share of completion words
that are "even" words (w0, w2, ...). Run: `python examples/tunix_grpo.py [--steps 2]` (docs/rl.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import utils as tunix_utils
from tunix.models.llama3 import model as llama3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jaxserve import LLM
from jaxserve.rl.tunix_rollout import JaxserveRollout, tunix_to_hf

V, H, I, L, NQ, NKV, HD = 256, 64, 128, 2, 4, 2, 16
THETA = 1_000_000  # Tunix 0.1.7's Llama3 rotates with 1e6 whatever its config says: the checkpoint agrees
EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})
PROMPTS = ["w5 w17 w3 w99", "w8 w9 w10 w11", "w40 w41", "w7 w7 w7 w1"]


def tiny_actor(seed: int) -> llama3.Llama3:
    """Tunix's Llama3 at a tiny config, its init scaled up so that samples vary with the weights."""
    cfg = llama3.ModelConfig(num_layers=L, vocab_size=V, embed_dim=H, hidden_dim=I, num_heads=NQ, head_dim=HD,
                             num_kv_heads=NKV, rope_theta=THETA, norm_eps=1e-6, weight_tying=False)
    actor = llama3.Llama3(cfg, rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    nnx.update(actor, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype),
                                   nnx.state(actor)))
    return actor


def hf_shapes() -> dict[str, tuple[int, ...]]:
    """The HF Llama parameter names and shapes of the tiny config."""
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (NQ * HD, H), p + "self_attn.k_proj.weight": (NKV * HD, H),
                       p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.o_proj.weight": (H, NQ * HD),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    return shapes


def save_hf(actor: llama3.Llama3, out: Path) -> Path:
    """The actor as an HF Llama directory (the adapter's own mapping) with a word-level tokenizer w0..w255."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    weights = tunix_to_hf(actor, hf_shapes())(nnx.state(actor))
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in weights.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=I,
        num_hidden_layers=L, num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=HD, rms_norm_eps=1e-6,
        rope_theta=float(THETA), max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, torch_dtype="float32")))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(out)
    return out


def even_words(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The toy verifiable reward: the share of the completion's words that are even words."""
    words = [c.split() for c in completions]
    return [sum(int(w[1:]) % 2 == 0 for w in ws if w[1:].isdigit()) / max(len(ws), 1) for ws in words]


def tunix_logprobs(actor: llama3.Llama3, ids: np.ndarray, prompt_len: int) -> np.ndarray:
    """Tunix's own forward of the actor: the logprob of each token after the prompt."""
    mask = jnp.ones(ids.shape, bool)
    logits, _ = actor(jnp.asarray(ids), tunix_utils.build_positions_from_mask(mask), None,
                      tunix_utils.make_causal_attn_mask(mask, ids.shape[1]))
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1)[..., 0])[:, prompt_len - 1:]


def check_engine_serves_actor(cluster: rl_cluster_lib.RLCluster, rollout_config: base_rollout.RolloutConfig) -> float:
    """Max |engine logprob - Tunix forward logprob| over fresh samples of the trained actor."""
    rollout, actor = cluster.rollout, cluster.actor_trainer.model
    out = rollout.generate(PROMPTS, rollout_config)
    worst = 0.0
    for row, tokens, logprobs in zip(out.left_padded_prompt_tokens, out.tokens, out.logprobs):
        prompt = [int(t) for t in row if t != rollout.pad_id()]
        ids = np.array([prompt + [int(t) for t in tokens]], np.int32)
        worst = max(worst, float(np.max(np.abs(logprobs - tunix_logprobs(actor, ids, len(prompt))[0]))))
    return worst


def main(steps: int = 2, num_generations: int = 4, max_tokens: int = 8, lr: float = 3e-3,
         work: Path | None = None) -> dict[str, Any]:
    """Tunix's GRPO for `steps` steps on PROMPTS x num_generations; returns the printed metrics, how far
    the actor moved, and the engine-vs-Tunix logprob gap after training."""
    t0 = time.perf_counter()
    work = work or Path(tempfile.mkdtemp(prefix="tunix_grpo_"))
    actor, reference = tiny_actor(0), tiny_actor(0)  # the reference: a separate copy of the initial policy
    llm = LLM(str(save_hf(tiny_actor(0), work / "ckpt")), **EXACT, max_model_len=64,
              max_num_seqs=len(PROMPTS) * num_generations, enforce_eager=True, progress=False)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],  # Auto: as Tunix's own models shard
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rollout_config = base_rollout.RolloutConfig(max_tokens_to_generate=max_tokens, max_prompt_length=8,
                                                temperature=1.0, return_logprobs=True, seed=jnp.array([0]))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                         rl_cluster_lib.Role.ROLLOUT)},
        rollout_engine=functools.partial(JaxserveRollout, llm=llm),
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adam(lr), eval_every_n_steps=1000, max_steps=steps,
            metrics_logging_options=None, checkpoint_root_directory=None),
        rollout_config=rollout_config)
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=llm.get_tokenizer(),
                                       cluster_config=cluster_config)
    printed: list[dict[str, float]] = []

    def log(buffer: Any) -> None:  # Tunix's metrics of each step, as its learner buffers them
        row = {k: float(np.mean(np.asarray(v))) for k, (v, _) in buffer.metrics.items()
               if np.asarray(v).dtype.kind in "fiub"}
        if not row:  # Tunix's perf buffers carry no numbers
            return
        printed.append(row)
        cells = ", ".join(f"{k}={v:.4g}" for k, v in sorted(row.items()))
        print(f"[{buffer.mode}] step {buffer.global_steps}: {cells}", flush=True)

    cluster.with_external_metrics_logger(log)
    try:
        return _train(cluster, actor, steps, num_generations, rollout_config, printed, t0)
    finally:
        llm.shutdown()


def _train(cluster: rl_cluster_lib.RLCluster, actor: llama3.Llama3, steps: int, num_generations: int,
           rollout_config: base_rollout.RolloutConfig, printed: list[dict[str, float]], t0: float) -> dict[str, Any]:
    learner = grpo_learner.GRPOLearner(cluster, grpo_learner.GRPOConfig(num_generations=num_generations, beta=0.04),
                                       reward_fns=[even_words])
    before = jax.tree.map(np.asarray, nnx.state(actor, nnx.Param))
    t_train = time.perf_counter()
    learner.train([{"prompts": np.array(PROMPTS)} for _ in range(steps)])  # batches as grain gives them
    train_s = time.perf_counter() - t_train
    trainer_log = cluster.actor_trainer.metrics_logger  # the trainer's own metrics (loss, KL), one per step
    for name in ("loss", "kl"):
        if trainer_log.metric_exists("actor", name, "train"):
            history = trainer_log.get_metric_history("actor", name, "train")
            print(f"[train] actor {name} per step: " + ", ".join(f"{float(v):.4g}" for v in history))
    moved = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in
                zip(jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param)), jax.tree.leaves(before)))
    worst = check_engine_serves_actor(cluster, rollout_config)
    print(f"trained {steps} step(s) in {train_s:.1f} s ({time.perf_counter() - t0:.1f} s in all); "
          f"actor moved by up to {moved:.3g}; engine vs Tunix forward of the trained actor: max |dlogprob| {worst:.2e}")
    return dict(metrics=printed, moved=moved, max_abs_dlogprob=worst, train_s=train_s)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    result = main(a.steps, a.num_generations, a.max_tokens, a.lr)
    if result["moved"] == 0.0 or result["max_abs_dlogprob"] > 1e-4:
        raise SystemExit("FAILED: the actor did not train, or the engine does not serve the trained actor")
