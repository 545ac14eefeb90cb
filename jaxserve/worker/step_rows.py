"""Which rows of a step's hidden states [T, hidden] the host reads back besides the sampled ones, in
chunks of one gather program's size (compiled per token bucket at warm-up):

    prompt logprobs   the rows scoring prompt tokens 1.. of the requests that asked (PromptLogprobChunk)
    pooling           a prefill-only request's first, last or every prompt row (what its pooler reads)

Plain numpy from the SchedulerOutput: PreparedStep carries them, so every rank of a multi-host run
replays the same gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput

PROMPT_LOGPROB_ROWS = 64  # rows per gather program call (prompt logprobs and pooling rows)


@dataclass(frozen=True)
class PromptLogprobChunk:
    rows: np.ndarray  # [PROMPT_LOGPROB_ROWS] i32, flat rows of this step's tokens, 0 padded
    targets: np.ndarray  # [PROMPT_LOGPROB_ROWS] i32, the next prompt token at each row
    entries: list[tuple[str, int, int, int]]  # (request id, prompt position, target id, top-N) per real row


def prompt_logprob_chunks(out: SchedulerOutput) -> list[PromptLogprobChunk]:
    """Which of this step's rows score prompt tokens 1.. for requests that asked, in program-sized chunks."""
    wanted = []  # (request id, prompt position of the target token, flat row, target id, top-N)
    row = 0
    for sr in out.scheduled:
        prompt, n = sr.prompt_token_ids, sr.sampling_params.prompt_logprobs
        if n is not None:
            for j in range(len(sr.token_ids)):
                pos = sr.start_pos + j
                if pos + 1 < len(prompt):
                    wanted.append((sr.request_id, pos + 1, row + j, prompt[pos + 1], n))
        row += len(sr.token_ids)
    chunks = []
    for chunk in in_chunks(wanted, PROMPT_LOGPROB_ROWS):
        rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
        targets = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
        rows[: len(chunk)] = [c[2] for c in chunk]
        targets[: len(chunk)] = [c[3] for c in chunk]
        chunks.append(PromptLogprobChunk(rows, targets, [(rid, pos, tok, n) for rid, pos, _, tok, n in chunk]))
    return chunks


def pooling_chunks(out: SchedulerOutput, which: str) -> tuple[list[np.ndarray], list[tuple[str, int]]]:
    """The flat rows of this step's pooling requests that their pooler reads (`which`: first, last or
    all of each prompt: the scheduler gives such a request its whole prompt in one step), in
    program-sized chunks, and (request id, number of rows) per request."""
    wanted: list[int] = []
    ids: list[tuple[str, int]] = []
    row = 0
    for sr in out.scheduled:
        n = len(sr.token_ids)
        if sr.pooling:
            picked = {"first": [row], "last": [row + n - 1]}.get(which, list(range(row, row + n)))
            wanted += picked
            ids.append((sr.request_id, len(picked)))
        row += n
    chunks = []
    for chunk in in_chunks(wanted, PROMPT_LOGPROB_ROWS):
        rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
        rows[: len(chunk)] = chunk
        chunks.append(rows)
    return chunks, ids


def in_chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]
