"""jaxserve.rl.tunix_rollout against Tunix itself (google-tunix==0.1.7, installed --no-deps by `make
setup`: its safetensors<0.8 pin conflicts with the test extra's transformers, docs/rl.md).

A tiny random Tunix Llama3 actor is pushed into an engine serving other random weights through the
adapter's update_params (Tunix's nnx state -> HF names -> LLM.update_weights); the engine's sampled
logprobs then equal Tunix's own forward of the actor (float32, 1e-4), and get_per_token_logps (the
engine's weights through jaxserve.models.forward) equals the sampler's logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.generate import utils as tunix_utils
from tunix.models.llama3 import model as llama3
from tunix.rl.rollout import base_rollout

from jaxserve.rl.tunix_rollout import JaxserveRollout, tunix_to_hf

V, H, I, L, NQ, NKV, HD = 256, 64, 128, 2, 4, 2, 16
# Tunix 0.1.7's Llama3 attention calls apply_rope without its config's rope_theta: it always rotates
# with the default 1e6, so the checkpoint says 1e6 too (a model of another theta would differ there)
THETA = 1_000_000
EXACT = dict(dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={})


def _actor(seed: int) -> llama3.Llama3:
    cfg = llama3.ModelConfig(num_layers=L, vocab_size=V, embed_dim=H, hidden_dim=I, num_heads=NQ, head_dim=HD,
                             num_kv_heads=NKV, rope_theta=THETA, norm_eps=1e-6, weight_tying=False)
    actor = llama3.Llama3(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(actor)  # larger than the init (and the norms not all ones), so outputs differ by seed
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    nnx.update(actor, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return actor


def _hf_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (NQ * HD, H), p + "self_attn.k_proj.weight": (NKV * HD, H),
                       p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.o_proj.weight": (H, NQ * HD),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,)})
    return shapes


def _save(actor: llama3.Llama3, out: Path) -> Path:
    """The actor as an HF Llama directory (the adapter's own mapping), with a word-level tokenizer."""
    from safetensors.numpy import save_file

    from tests.moe_fixtures import save_word_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    weights = tunix_to_hf(actor, _hf_shapes())(nnx.state(actor))
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in weights.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=I,
        num_hidden_layers=L, num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=HD, rms_norm_eps=1e-6,
        rope_theta=float(THETA), max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, torch_dtype="float32")))
    save_word_tokenizer(out, V)
    return out


def _tunix_logprobs(actor: llama3.Llama3, ids: np.ndarray, prompt_len: int) -> np.ndarray:
    mask = jnp.ones(ids.shape, bool)
    logits, _ = actor(jnp.asarray(ids), tunix_utils.build_positions_from_mask(mask), None,
                      tunix_utils.make_causal_attn_mask(mask, ids.shape[1]))
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], -1)[..., 0])[:, prompt_len - 1:]


def test_update_params_then_rollout_equals_tunix_forward(tmp_path):
    from jaxserve import LLM

    trained = _actor(1)
    llm = LLM(str(_save(_actor(0), tmp_path / "ckpt")), **EXACT, max_model_len=64, max_num_seqs=4,
              enforce_eager=True, progress=False)
    try:
        # as RLCluster builds a custom engine: a BaseRollout subclass called with these keywords
        assert issubclass(JaxserveRollout, base_rollout.BaseRollout)
        rollout = JaxserveRollout(rollout_actor=trained, tokenizer=None, mesh=None, rollout_config=None, llm=llm)
        # model() is None: the actor would read as sharing the engine's weights, and Tunix would never sync
        assert rollout.model() is None and rollout.eos_id() == 2
        rollout.update_params(nnx.state(trained, nnx.Param), (nnx.Param,))
        cfg = base_rollout.RolloutConfig(max_tokens_to_generate=5, temperature=1.0, max_prompt_length=6,
                                         return_logprobs=True, seed=jnp.array([3]))
        prompts = ["w5 w17 w3 w99", "w8 w9 w10 w11 w12 w13 w14 w15"]  # the second is cut to its last 6 tokens
        out = rollout.generate(prompts, cfg)
        assert isinstance(out, base_rollout.RolloutOutput) and len(out.text) == 2
        assert out.left_padded_prompt_tokens.shape == (2, 6)
        assert list(out.left_padded_prompt_tokens[1]) == [10, 11, 12, 13, 14, 15]
        for row, tokens, logprobs in zip(out.left_padded_prompt_tokens, out.tokens, out.logprobs):
            prompt = [t for t in row if t != rollout.pad_id()]
            ids = np.array([prompt + list(tokens)], np.int32)
            np.testing.assert_allclose(logprobs, _tunix_logprobs(trained, ids, len(prompt))[0], atol=1e-4)
        # the trainer-side logprobs of the same completions (jaxserve.models.forward on the engine's weights)
        width = max(len(t) for t in out.tokens)
        completion = np.array([list(t) + [rollout.pad_id()] * (width - len(t)) for t in out.tokens], np.int32)
        ours = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens, completion))
        for i, logprobs in enumerate(out.logprobs):
            np.testing.assert_allclose(ours[i, :len(logprobs)], logprobs, atol=1e-4)
        # Tunix repeats a prompt num_generations times in one call with one seed: the group must differ
        group = rollout.generate([prompts[0]] * 4, cfg).tokens
        assert len({tuple(t) for t in group}) > 1
    finally:
        llm.shutdown()


def test_tunix_grpo_learner_trains_through_jaxserve(tmp_path):
    """examples/tunix_grpo.py, one step: Tunix's own GRPOLearner and RLCluster sample with jaxserve, train
    Tunix's actor, sync it into the engine (update_params); the engine then serves the trained actor:
    its sampled logprobs equal Tunix's forward of the trained actor within 1e-4 (without the sync the gap
    is ~10 nats)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "tunix_grpo.py"
    spec = importlib.util.spec_from_file_location("tunix_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(steps=1, work=tmp_path)
    assert result["metrics"] and "rewards/score/mean" in result["metrics"][0]
    assert result["moved"] > 0.0
    assert result["max_abs_dlogprob"] < 1e-4

