"""jaxserve.rl.tunix_rollout against Tunix itself (google-tunix==0.1.7, installed --no-deps by `make
setup`: its safetensors<0.8 pin conflicts with the test extra's transformers, docs/rl.md).

A tiny random Tunix Llama3 actor is pushed into an engine serving other random weights through the
adapter's update_params (Tunix's nnx state -> HF names -> LLM.update_weights); the engine's sampled
logprobs then equal Tunix's own forward of the actor (float32, 1e-4), and get_per_token_logps (the
engine's weights through jaxserve.models.forward) equals the sampler's logprobs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jaxserve.rl.tunix_rollout import JaxserveRollout

# examples/tunix_grpo.py (not a package): its tiny Tunix actor, HF directory and Tunix forward
_spec = importlib.util.spec_from_file_location(
    "tunix_grpo_example", Path(__file__).resolve().parent.parent / "examples" / "tunix_grpo.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_update_params_then_rollout_equals_tunix_forward(tmp_path):
    from jaxserve import LLM

    trained = example.tiny_actor(1)
    llm = LLM(str(example.save_hf(example.tiny_actor(0), tmp_path / "ckpt")), **example.EXACT, max_model_len=64, max_num_seqs=4,
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
            np.testing.assert_allclose(logprobs, example.tunix_logprobs(trained, ids, len(prompt))[0], atol=1e-4)
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
    result = example.main(steps=1, work=tmp_path)
    assert result["metrics"] and "rewards/score/mean" in result["metrics"][0]
    assert result["moved"] > 0.0
    assert result["max_abs_dlogprob"] < 1e-4

