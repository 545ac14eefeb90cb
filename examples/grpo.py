# %% [markdown]
# # GRPO with optax, trainer and engine in one process
#
# The policy is the model the engine serves. Each step: the engine samples `n` completions of each
# prompt (token ids and their logprobs), a verifiable reward scores them, the GRPO loss is computed
# with `jaxserve.models.forward` (the engine's own model code, on the engine's own param tree),
# optax steps, and `LLM.update_weights(params)` hands the new arrays back to the engine: no
# conversion, no copy, no second process. docs/rl.md says what each call does.
#
# The toy task: describe things in a few words; the reward is 1 when the completion names a colour
# (a verifiable check: a word of COLOURS). Run: `python examples/grpo.py` (SmolLM2-135M, float32 on the CPU: a few
# minutes); `--help` for the knobs. examples/grpo.ipynb holds the same cells (after an edit here:
# `python tests/test_grpo_example.py` writes it again; the test checks they agree).

# %%
from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve import LLM, SamplingParams
from jaxserve.models import forward, token_logprobs

COLOURS = {"red", "orange", "yellow", "green", "blue", "purple", "violet", "pink", "brown", "black", "white",
           "grey", "gray", "silver", "golden", "gold", "turquoise", "crimson", "scarlet", "azure", "emerald"}
SUBJECTS = ["the sky", "the sea", "a car", "a flower", "a bird", "a house", "a dress", "a river",
            "a painting", "a shirt", "the night", "a gemstone", "a butterfly", "a door", "a lake", "a toy"]


# %% [markdown]
# ## Rollouts: `n` samples per prompt, token ids and their logprobs, from the engine

# %%
def make_prompts(llm: LLM, subjects: list[str]) -> list[list[int]]:
    """Each subject as a chat prompt's token ids (the engine takes token ids as they are)."""
    tok = llm.get_tokenizer()
    prompts = []
    for s in subjects:
        messages = [{"role": "user", "content": f"Describe {s} in a few words."}]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (ValueError, AttributeError):  # a tokenizer without a chat template
            text = messages[0]["content"]
        prompts.append(list(tok.encode(text, add_special_tokens=False)))
    return prompts


def rollout(llm: LLM, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> tuple[list, float, int]:
    """n completions of each prompt: [(prompt ids, completion ids, their logprobs, text)], seconds, tokens.
    logprobs=0: the sampled token's logprob at every position, nothing more."""
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed * 1000 + i)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    samples = [(p, list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], c.text)
               for p, out in zip(prompts, outs) for c in out.outputs]
    return samples, seconds, sum(len(s[1]) for s in samples)


def reward(text: str, words: set[str] = COLOURS) -> float:
    """Verifiable: 1 when the completion names one of `words`."""
    return float(any(w in words for w in re.findall(r"[a-z]+", text.lower())))


# %% [markdown]
# ## The batch the trainer sees, and the GRPO loss over `jaxserve.models.forward`

# %%
def make_batch(samples: list, rewards: np.ndarray, n: int, length: int) -> dict[str, np.ndarray]:
    """[B, length] rows of prompt + completion, right-padded: token ids, positions, the attention
    mask, the completion mask (which next-token predictions are trained), the sampler's logprobs
    and each row's group-normalised advantage."""
    rows = len(samples)
    ids, mask, trained = (np.zeros((rows, length), np.int32) for _ in range(3))
    old = np.zeros((rows, length - 1), np.float32)
    for r, (prompt, completion, logprobs, _) in enumerate(samples):
        seq = (prompt + completion)[:length]
        ids[r, :len(seq)], mask[r, :len(seq)] = seq, 1
        first, last = len(prompt) - 1, len(seq) - 1  # prediction t is of token t + 1
        trained[r, first:last] = 1
        old[r, first:last] = logprobs[:last - first]
    groups = rewards.reshape(-1, n)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
    return dict(ids=ids, positions=positions, mask=mask, trained=trained[:, :-1].astype(np.float32),
                old=old, adv=adv.reshape(-1).astype(np.float32))


def grpo_loss(params, ref_params, batch, *, config, beta: float, clip: float):
    """GRPO (DeepSeekMath): the clipped policy-gradient term on the sampler's logprobs (the
    importance ratio corrects any trainer/sampler difference) plus beta * KL to the reference
    (k3 estimator), averaged over each completion's tokens, then over completions."""
    fwd = functools.partial(forward, config=config, attention_mask=batch["mask"])
    logp = token_logprobs(fwd(params, batch["ids"], batch["positions"]), batch["ids"])
    ref = jax.lax.stop_gradient(token_logprobs(fwd(ref_params, batch["ids"], batch["positions"]), batch["ids"]))
    ratio = jnp.exp(logp - batch["old"])
    adv = batch["adv"][:, None]
    pg = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1
    m = batch["trained"]
    per_seq = lambda x: jnp.sum(x * m, 1) / jnp.maximum(jnp.sum(m, 1), 1)  # noqa: E731
    loss = -jnp.mean(per_seq(pg - beta * kl))
    mismatch = jnp.max(jnp.abs(logp - batch["old"]) * m)  # the engine's logprobs against the trainer's
    return loss, dict(kl=jnp.mean(per_seq(kl)), mismatch=mismatch)


# %% [markdown]
# ## The loop: rollout, reward, optax step, `update_weights`

# %%
def train(llm: LLM, *, steps: int, subjects: list[str], n: int, max_tokens: int, words: set[str] = COLOURS,
          lr: float = 3e-5, beta: float = 0.04, clip: float = 0.2, seed: int = 0, log=print) -> list[dict]:
    """GRPO on the engine's own weights; returns one dict of figures a step."""
    config = llm.llm_engine.model.config
    params = llm.engine_params()  # the served arrays themselves: the trainer starts from them
    ref_params = jax.tree.map(jnp.copy, params)  # the frozen reference of the KL term
    opt = optax.adam(lr)
    opt_state = opt.init(params)
    prompts = make_prompts(llm, subjects)
    length = max(len(p) for p in prompts) + max_tokens  # one shape: one compilation

    @jax.jit  # ref_params an argument, not a closure: a closure's arrays would be baked into the program
    def update(params, ref_params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
            params, ref_params, batch, config=config, beta=beta, clip=clip)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(aux, loss=loss)

    history = []
    for step in range(steps):
        samples, rollout_s, tokens = rollout(llm, prompts, n, max_tokens, seed + step)
        rewards = np.array([reward(s[3], words) for s in samples], np.float32)
        t0 = time.perf_counter()
        params, opt_state, aux = update(params, ref_params, opt_state, make_batch(samples, rewards, n, length))
        jax.block_until_ready(params)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.update_weights(params, version=step + 1)  # adopted as they are: same tree, devices, dtypes
        sync_s = time.perf_counter() - t0
        row = dict(step=step + 1, reward=float(rewards.mean()), kl=float(aux["kl"]), loss=float(aux["loss"]),
                   mismatch=float(aux["mismatch"]), sync_s=sync_s, train_s=train_s,
                   rollout_tok_s=tokens / rollout_s)
        history.append(row)
        log(f"step {row['step']:3d}  reward {row['reward']:.3f}  kl {row['kl']:.5f}  loss {row['loss']:+.4f}  "
            f"max|dlogp| {row['mismatch']:.1e}  sync {sync_s:.4f}s  train {train_s:.1f}s  "
            f"rollout {row['rollout_tok_s']:.0f} tok/s")
    return history


# %% [markdown]
# ## Run it

# %%
def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description="GRPO with optax on the engine's own weights (examples/grpo.py)")
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step (the first of SUBJECTS)")
    ap.add_argument("--n", type=int, default=4, help="samples a prompt (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # float32 and no CPU shortcuts (bfloat16 KV, n-gram drafts), so the engine samples from exactly
    # the distribution the trainer's forward computes; enforce_eager: compile the shapes the rollouts
    # use when first met, not every bucket at start-up
    llm = LLM(args.model, dtype="float32", kv_cache_dtype="auto", block_size=16, speculative_config={},
              max_model_len=128, max_num_seqs=args.prompts * args.n, enforce_eager=True, progress=False)
    return train(llm, steps=args.steps, subjects=SUBJECTS[:args.prompts], n=args.n, max_tokens=args.max_tokens,
                 lr=args.lr, beta=args.beta, seed=args.seed)


# %%
if __name__ == "__main__":  # the notebook runs `history = main(["--steps", "20"])` instead
    main()
