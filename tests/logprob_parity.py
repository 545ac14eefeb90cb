"""Logprob parity with transformers (or transformers + peft): the reference of every parity test that
generates (MoE families, gpt-oss, LoRA adapters), beside the greedy tokens.

Greedy tokens alone cannot catch an error that leaves the argmax in place (a wrong scale on a
small term, a missed bias, a softmax over the wrong axis on a peaked distribution); the logprob
of each generated token can: it is compared with transformers' float32 log_softmax of the logits
of one forward pass over the whole sequence (prompt + generated tokens, teacher-forced), so the
reference shares nothing with the engine's cache, batching or sampler.
"""

from __future__ import annotations

# float32 on both sides, the same weights: the logits differ by summation order only (~1e-6 of their
# scale over a few layers), so a generated token's logprob -- within a few units of 0 -- agrees to
# 1e-4; an error in the model moves it by far more.
LOGPROB_TOL = 1e-4


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of `model`'s float32 logits at each generated position, taken at the token
    generated there: one forward over prompt + tokens (a transformers or peft causal LM)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    steps = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # the logits that chose each token
    logprobs = torch.log_softmax(steps, dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def generated_logprobs(completion) -> list[float]:
    """The engine's logprob of each generated token of a CompletionOutput (asked with logprobs=0)."""
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    return [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]


def assert_logprobs_close(got: list[list[float]], want: list[list[float]], tol: float = LOGPROB_TOL,
                          what: str = "") -> None:
    """Every sequence's logprobs within `tol` of the reference's, position by position."""
    assert [len(g) for g in got] == [len(w) for w in want], what
    worst = max((abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)), default=0.0)
    assert worst < tol, f"{what}: a generated token's logprob differs from the reference by {worst:.2e}"
