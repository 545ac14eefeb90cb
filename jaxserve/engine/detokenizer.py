"""Incremental detokenization with stop strings, for streaming.

Token ids arrive one step at a time; text must come out as soon as it is
final and never be taken back. Two things make a token's text not final yet:

1. Byte-level tokens can split a multi-byte UTF-8 character; decoding such a
   tail yields "\\ufffd". Like vLLM, we decode a short window of ids
   (prefix_offset .. end) and emit only the part past read_offset once the
   window no longer ends in "\\ufffd". Decoding a window that starts a few
   tokens back (and, at the start, inside the prompt) also keeps leading-space
   rules (SentencePiece "▁", byte-level "Ġ") right.

       ids:  ... p p p p p | o o o o | o o
                 ^prefix_offset      ^read_offset     (all emitted text is
                 decode(prefix..read) = prefix_text    before read_offset)
                 decode(prefix..end)  = prefix_text + new text

2. Text that may become a stop string. We hold back the longest suffix of
   the text that is a prefix of some stop string and release it once it
   stops matching. When a stop string appears, the text is cut there (kept
   with include_stop_str_in_output) and nothing after it is emitted.

Step 1 is what `tokenizers`' DecodeStream does natively: with a fast tokenizer
(one backed by a `tokenizers.Tokenizer`, as every GGUF and HF-converted model's
here) each id goes through `DecodeStream.step`, which returns None while a
character is incomplete; the window above is the fallback for slow tokenizers
and for those that post-process decoded text (clean_up_tokenization_spaces).
Both keep the same window of ids, so `flush()` decodes the rest the same way.

When a request ends for another reason (eos, max_tokens), call `flush()` for
the held-back rest. Invariant: the concatenation of all deltas (plus the
flush) equals `output_text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the window path only
    DecodeStream = None

# Prompt tokens decoded in front of the first output token (vLLM uses 5 too).
_INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _stream_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` DecodeStream can drive, or None when decode() is more than its decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, Tokenizer) \
            or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, use_decode_stream: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        # Only the window of the prompt we decode in front of the output is kept. A prompt
        # ending inside a UTF-8 character would glue its bytes to the output's: decode the
        # output on its own then.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        if self._decode(0, None).endswith(_REPLACEMENT_CHAR):
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stream, self._backend = None, _stream_backend(tokenizer) if use_decode_stream else None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in self._ids:  # the prompt's tail: leading-space context, its text dropped
                self._stream.step(self._backend, token_id)
        self._num_fed = 0
        self._text = ""  # final output text (truncated at a stop string)
        self._num_emitted = 0  # chars of _text already returned as deltas
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def output_text(self) -> str:
        """All complete text decoded so far, cut at the stop string once one matched.

        It may run ahead of the deltas by a held-back stop-string prefix; once
        finished (stop matched, or flush()) it equals the joined deltas.
        """
        return self._text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        return self._stop_reason is not None or self._flushed

    @property
    def num_fed(self) -> int:
        """Generated ids taken so far; add_tokens takes none after the one that completes a stop string."""
        return self._num_fed

    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed newly generated ids; return (text safe to emit now, matched stop string or None).

        After a stop string matched, the request is over: further calls raise.
        """
        if self.finished:
            raise RuntimeError("add_tokens after the output finished (stop string or flush)")
        for token_id in token_ids:
            self._ids.append(token_id)
            self._num_fed += 1
            start = len(self._text)
            self._text += self._decode_next()
            # Per token, so the stop found does not depend on how ids were grouped into calls.
            self._check_stop(start)
            if self._stop_reason is not None:
                break
        return self._emit(final=self._stop_reason is not None), self._stop_reason

    def flush(self) -> str:
        """End of the request without a stop string: release everything held back.

        An incomplete UTF-8 tail is emitted as "\\ufffd", as a full decode would.
        """
        if self._stop_reason is not None or self._flushed:
            return ""
        start = len(self._text)
        self._text += self._decode(self._prefix_offset, None)[
            len(self._decode(self._prefix_offset, self._read_offset)):]
        self._read_offset = len(self._ids)
        self._check_stop(start)
        self._flushed = True
        return self._emit(final=True)

    def _decode(self, start: int, end: int | None) -> str:
        return self._tokenizer.decode(self._ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self) -> str:
        """The text the last id completes, or "" while it is incomplete (DecodeStream, or vLLM's window)."""
        if self._stream is not None:
            text = self._stream.step(self._backend, self._ids[-1])
            if not text:
                return ""
            self._advance_window()
            return text
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, None)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance_window()
        return new_text[len(prefix_text):]

    def _advance_window(self) -> None:
        """The ids up to the last one are emitted text: the window moves past them."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids before the window so memory stays bounded on long outputs.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _check_stop(self, start: int) -> None:
        """Cut the text at a stop string ending in the text added since `start`.

        Among the stop strings completed by the same token, the one starting first wins.
        """
        if not self._stop or len(self._text) == start:
            return
        longest = max(len(s) for s in self._stop)
        search_from = max(0, start - longest + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self._text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self._text = self._text[:i + len(s)] if self._include_stop else self._text[:i]
        self._stop_reason = s

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        held = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), held, -1):
                if self._text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _emit(self, final: bool) -> str:
        end = len(self._text) if final else len(self._text) - self._held_back_len()
        end = max(end, self._num_emitted)
        delta = self._text[self._num_emitted:end]
        self._num_emitted = end
        return delta
