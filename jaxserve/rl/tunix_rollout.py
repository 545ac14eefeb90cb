"""jaxserve as Tunix's rollout engine: a `tunix.rl.rollout.base_rollout.BaseRollout`.

    from jaxserve import LLM
    from jaxserve.rl.tunix_rollout import JaxserveRollout
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype="auto", speculative_config={})
    cluster_config = rl_cluster_lib.ClusterConfig(
        rollout_engine=functools.partial(JaxserveRollout, llm=llm), ...)

Tunix builds the rollout with (rollout_actor=, tokenizer=, mesh=, rollout_config=) and then calls
generate(prompts, rollout_config) for each batch of prompt strings and update_params(state) after
each trainer step. The engine lives in the trainer's process: update_params maps the actor's nnx
state to Hugging Face names (Tunix's own checkpoint mapping of the actor's family, inverted) and
hands them to `LLM.update_weights`, which places them on the engine's shardings (one copy: Tunix's
layout is not the engine's). Tested against google-tunix==0.1.7, Tunix's own GRPOLearner included
(tests/test_tunix_rollout.py, examples/tunix_grpo.py).
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("jaxserve.rl.tunix_rollout needs Tunix: pip install google-tunix==0.1.7 "
                      "(docs/rl.md says what it pins)") from e

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.llm import LLM
from jaxserve.models.training import forward, token_logprobs

# (actor's nnx state) -> {HF name: array}
ToHF = Callable[[Any], Mapping[str, Any]]


class JaxserveRollout(base_rollout.BaseRollout):
    """Tunix's rollout worker over an `LLM` in this process. `to_hf`: the actor state -> HF-named
    weights (default: Tunix's safetensors key mapping of the actor's family, inverted)."""

    def __init__(self, rollout_actor: Any = None, tokenizer: Any = None, mesh: Any = None,
                 rollout_config: Any = None, *, llm: LLM, to_hf: ToHF | None = None) -> None:
        self._llm, self._actor = llm, rollout_actor
        self._hf_shapes = {k: tuple(v.shape) for k, v in llm.get_weights().items()}
        self._to_hf = to_hf or (tunix_to_hf(rollout_actor, self._hf_shapes) if rollout_actor is not None else None)
        eos = tuple(llm.llm_engine.model.config.eos_token_ids)  # config.json's / the GGUF's, as the engine stops
        pad = getattr(llm.get_tokenizer(), "pad_token_id", None)
        self._eos = int(eos[0]) if eos else 0
        self._pad = int(pad if pad is not None else self._eos)
        self._calls = 0  # generate calls so far: part of each row's seed

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: Any) -> base_rollout.RolloutOutput:
        """One completion of each prompt string (Tunix repeats a prompt for its group itself)."""
        cfg = rollout_config
        self._calls += 1
        # Tunix repeats each prompt num_generations times in one call with one seed: one seed per row
        # (and per call) keeps the group's samples distinct, and a seeded run reproducible
        base = None if cfg.seed is None else int(np.asarray(cfg.seed).reshape(-1)[0]) * 1_000_003 + self._calls * 10_007
        seeds = [None if base is None else base + i for i in range(len(prompts))]
        params = [SamplingParams(
            max_tokens=cfg.max_tokens_to_generate, temperature=cfg.temperature, top_p=cfg.top_p or 1.0,
            top_k=cfg.top_k or 0, seed=None if seed is None else seed % (2**31),
            stop_token_ids=list(cfg.eos_tokens or []), logprobs=0 if cfg.return_logprobs else None) for seed in seeds]
        # tokenized as the engine tokenizes text, cut to the last max_prompt_length tokens
        ids = [self._llm.llm_engine.encode_prompt(p)[1][-cfg.max_prompt_length:] for p in prompts]
        outs = self._llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        padded = np.full((len(outs), cfg.max_prompt_length), self._pad, np.int32)  # left-padded, as Tunix's
        for i, prompt in enumerate(ids):
            padded[i, cfg.max_prompt_length - len(prompt):] = prompt
        done = [out.outputs[0] for out in outs]
        logprobs = None
        if cfg.return_logprobs:
            logprobs = [np.array([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], np.float32)
                        for c in done]
        return base_rollout.RolloutOutput(text=[c.text for c in done], logits=None,
                                          tokens=[np.array(c.token_ids, np.int32) for c in done],
                                          left_padded_prompt_tokens=padded, logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """[B, C] log-probabilities of completion_tokens (right-padded) after prompt_tokens
        (left-padded with pad_id), by the engine's own weights and model code (models/training.py)."""
        prompt, completion = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        ids = np.concatenate([prompt, completion], axis=1).astype(np.int32)
        mask = np.concatenate([prompt != self._pad, np.ones_like(completion, bool)], axis=1)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        logits = forward(self._llm.engine_params(), ids, positions, config=self._llm.llm_engine.model.config,
                         attention_mask=mask)
        return token_logprobs(logits, jnp.asarray(ids))[:, prompt.shape[1] - 1:]

    def update_params(self, params: Any, filter_types: Any = None) -> None:
        """The actor's state (or a part of it) into the engine, by HF name (LLM.update_weights)."""
        if self._to_hf is None:
            raise ValueError("update_params: JaxserveRollout was built without rollout_actor or to_hf; "
                             "give to_hf= (the actor state -> {Hugging Face name: array})")
        self._llm.update_weights(dict(self._to_hf(params)))

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return self._eos

    def model(self) -> Any:
        """None: the engine holds its own copy of the weights, not an nnx module. Returning the actor
        Tunix handed in (its trainer's own model) would make Tunix's learner conclude that trainer and
        rollout share weights (rl_utils.is_sharing_weights) and never call update_params after a step.
        So ClusterConfig(offload_to_cpu=True), which moves this module between memories, is not
        supported: sleep the engine (LLM.sleep) instead."""
        return None


def tunix_to_hf(actor: Any, hf_shapes: Mapping[str, tuple[int, ...]]) -> ToHF:
    """Tunix's HF -> nnx key mapping of the actor's family (tunix.models.<family>.params), inverted:
    each nnx leaf back to its HF name, un-reshaped and un-permuted to HF's [out, in] layout."""
    family = type(actor).__module__.rsplit(".", 1)[0]  # tunix.models.llama3.model -> tunix.models.llama3
    mapping = importlib.import_module(family + ".params")._get_key_and_transform_mapping(actor.config)
    rules = []
    for hf_pattern, (nnx_pattern, transform) in mapping.items():
        nnx_re = re.compile("^" + re.escape(nnx_pattern).replace(re.escape("\\1"), "([0-9]+)") + "$")
        rules.append((nnx_re, hf_pattern, transform))

    def hf_name(hf_pattern: str, match: re.Match) -> str:
        name = hf_pattern.replace("([0-9]+)", match.group(1) if match.groups() else "")
        return name.replace("\\.", ".")

    def to_hf(state: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, value in nnx.to_flat_state(state):
            key = ".".join(str(p) for p in path)
            x = getattr(value, "value", value)
            for nnx_re, hf_pattern, transform in rules:
                m = nnx_re.match(key)
                if m is None:
                    continue
                name = hf_name(hf_pattern, m)
                if name not in hf_shapes:
                    raise ValueError(f"update_params: {key} maps to {name}, which the served model lacks")
                if transform is not None:  # undo Tunix's (permute, reshape) of the [out, in] tensor
                    perm = transform[0]
                    x = jnp.reshape(x, [hf_shapes[name][i] for i in perm]).transpose(np.argsort(perm))
                out[name] = x
                break
            else:
                raise ValueError(f"update_params: no Hugging Face name for the actor's {key}")
        return out

    return to_hf
