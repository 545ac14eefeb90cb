"""Structured outputs: grammars, one matcher per request, and each step's token bitmask.

Library: llguidance (pinned in pyproject.toml). Why not xgrammar, vLLM's default: llguidance's
Python package needs only numpy (xgrammar's wheel depends on torch, which jaxserve does not
load at run time), it fills an int32 bitmask in place through a pointer from a thread pool
without the GIL, its Earley parser compiles a JSON schema lazily (milliseconds, so a request
barely waits) and handles schemas xgrammar refuses, and it supports speculative drafts natively
(`rollback`, a mask per draft position in one call). vLLM ships it as the `guidance` backend.

Data flow (vLLM V1's, in this project's words):

    add_request   params with structured_outputs -> grammar compiled on a thread pool, cached
                  by its spec; the request stays in `waiting` until `is_ready` (not the batch)
    schedule      fill_bitmask(out): [rows, W] int32, one row per sampling row of the step in
                  the runner's order (a request with k drafts has k + 1 rows: row j uses the
                  matcher advanced by drafts[:j], rolled back after); -1 (all bits) for
                  unconstrained rows; None when no row is constrained
    device        sampler: logits of a 0 bit -> -inf
    update        accept(rid, tokens): the matcher advances on each accepted token

`allowed_token_ids` and `bad_words` travel in the same bitmask: a request's allowed set is one
precomputed row ANDed in; a bad word's last token is cleared where the output ends with the
word's other tokens (vLLM's rule; each word as written and with a leading space).

JSON schemas read as vLLM's default backend (xgrammar) reads them, in its strict mode: an object
schema that does not say `additionalProperties` (or `unevaluatedProperties`) gets no keys beyond
its `properties`, an array schema without `items` no items beyond its `prefixItems` (a bare
{"type": "object"} is `{}`, {"type": "array"} is `[]`); `strict_json_schema` writes that into the
schema, because llguidance follows JSON Schema (extra keys allowed) and has no option for it (vLLM's
`guidance` backend does the same for `disable_additional_properties`). Whitespace as vLLM's default:
free (`[ \n\t]*`, xgrammar's) between tokens; `disable_any_whitespace=True` allows none (vLLM's
documented meaning; a small model given free whitespace may loop on newlines until max_tokens).
`json_object` stays any JSON object (OpenAI's meaning).
Pure Python + numpy; no JAX.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.core.scheduler_output import RequestUpdate, ScheduledRequest

logger = logging.getLogger("jaxserve.structured_output")
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used first out
GRAMMAR_CACHE_CHARS = 32 * 1024 * 1024  # and their specs' characters together: many huge schemas evict sooner
# llguidance's resource limits, explicit: compiling a grammar, and each token's mask, stop with an
# error (the request alone is refused or aborted) past these, instead of taking unbounded time or memory.
GRAMMAR_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                      max_lexer_states=250_000, max_grammar_size=500_000, max_items_in_row=2000)


def grammar_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


# vLLM's default lets whitespace go between JSON tokens: xgrammar's any_whitespace is `[ \n\t]*`
# (llguidance's own flexible default adds \r). disable_any_whitespace: "compact without any
# whitespace" (vLLM's docs; its guidance backend emits exactly that).
FLEXIBLE_JSON = {"whitespace_pattern": r"[\x20\x0A\x09]+"}
COMPACT_JSON = {"whitespace_flexible": False}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
               "allOf", "anyOf", "oneOf")


def strict_json_schema(schema: dict | bool) -> dict | bool:
    """A copy of `schema` in which every object and array schema that leaves extra properties or
    items unsaid forbids them (xgrammar's strict mode, vLLM's default); explicit ones are kept."""
    schema = copy.deepcopy(schema)
    _forbid_unnamed(schema)
    return schema


def _forbid_unnamed(node: object) -> None:
    if isinstance(node, list):
        for item in node:
            _forbid_unnamed(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _forbid_unnamed(sub)
    for key in _SUBSCHEMAS:
        _forbid_unnamed(node.get(key))
    if "const" in node or "enum" in node:  # the value is given: nothing to generate
        return
    kind = node.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    # Untyped schemas are read by their keywords, as xgrammar does.
    if (types is None and ("properties" in node or "patternProperties" in node)) or (types and "object" in types):
        if "additionalProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
    if (types is None and ("prefixItems" in node or "items" in node)) or (types and "array" in types):
        if isinstance(node.get("items"), list):  # draft 7's tuple form: extra items are additionalItems
            node.setdefault("additionalItems", False)
        elif not any(k in node for k in ("items", "additionalItems", "unevaluatedItems")):
            node["items"] = False


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for one request's constraint; ValueError on bad JSON."""
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON schema must be an object")
        if kind == "json":
            schema = strict_json_schema(schema)
        options = COMPACT_JSON if so.disable_any_whitespace else FLEXIBLE_JSON
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex or "")
    if kind == "choice":
        # JSON string literals are Lark string literals: every choice matched exactly.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice or []))
    grammar = so.grammar or ""
    if "::=" in grammar:  # GBNF / EBNF (llama.cpp's, as vLLM accepts it)
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001  (its parser raises plain exceptions)
            raise ValueError(f"structured_outputs.grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def validate_structured_outputs(so: StructuredOutputsParams, field_name: str = "structured_outputs") -> None:
    """ValueError naming `field_name` and the problem for a schema, regex or grammar llguidance
    refuses. Needs no tokenizer (a few ms), so the HTTP layer answers 400 before admission."""
    try:
        spec = grammar_spec(so)
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs", field_name, 1)) from None
    error = llguidance.LLMatcher.validate_grammar(spec, limits=grammar_limits())
    if error:
        raise ValueError(f"{field_name}: invalid {so.kind}: {error.strip()}")


@dataclass
class _RequestState:
    """One request's constraint: its matcher (when it has a grammar) and its fixed token rules."""
    grammar: Future[llguidance.LLMatcher] | None
    allowed: np.ndarray | None  # [W] i32 bits of allowed_token_ids, or None
    bad_words: list[list[int]]  # token ids of each bad word form
    history: list[int] = field(default_factory=list)  # accepted outputs (bad_words only)
    matcher: llguidance.LLMatcher | None = None


class StructuredOutputManager:
    """Owns each constrained request's matcher; the scheduler calls it (see the module docstring)."""

    def __init__(self, tokenizer: object | None, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 num_workers: int = 2) -> None:
        self.hf_tokenizer = tokenizer  # a transformers fast tokenizer; None: constraints are refused
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.num_words = (vocab_size + 31) // 32
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache (held briefly: the engine thread takes it)
        self._tokenizer_lock = threading.Lock()  # held ~1 s by the first compile, on the pool
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_chars = 0
        self.requests: dict[str, _RequestState] = {}

    # ---- compile -------------------------------------------------------------------------------
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built once, on first use (about a second): servers that never constrain never pay it."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                eos = self.eos_token_ids or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            return self._ll_tokenizer

    def _compile(self, spec: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), spec, log_level=0, limits=grammar_limits())
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def compile(self, so: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A pristine matcher for `so`, compiled on the pool; the same future for the same spec."""
        spec = grammar_spec(so)
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self._cache_chars += len(spec)
            while len(self._cache) > 1 and (len(self._cache) > GRAMMAR_CACHE_SIZE
                                            or self._cache_chars > GRAMMAR_CACHE_CHARS):
                old, _ = self._cache.popitem(last=False)
                self._cache_chars -= len(old)
        return future

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        if not params.needs_token_mask:
            return
        if self.hf_tokenizer is None or self.vocab_size <= 0:
            raise ValueError("structured_outputs: this engine has no tokenizer to constrain tokens with")
        so = params.structured_outputs
        allowed = None
        if params.allowed_token_ids:
            allowed = np.zeros(self.num_words, np.uint32)
            ids = np.asarray([t for t in params.allowed_token_ids if t < self.vocab_size], np.int64)
            np.bitwise_or.at(allowed, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
            allowed = allowed.view(np.int32)
        self.requests[request_id] = _RequestState(
            grammar=self.compile(so) if so is not None else None, allowed=allowed,
            bad_words=self._bad_word_ids(params.bad_words or []))

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        forms: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = list(self.hf_tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in forms:
                    forms.append(ids)
        return forms

    def is_ready(self, request_id: str) -> bool:
        """False while the request's grammar compiles: the scheduler leaves it waiting."""
        state = self.requests.get(request_id)
        return state is None or state.grammar is None or state.grammar.done()

    def grammar_error(self, request_id: str) -> str | None:
        """Why the request's grammar failed to compile (admission validated the spec, so this is
        llguidance's limits), or None: compiled, still compiling, or unconstrained."""
        state = self.requests.get(request_id)
        if state is None or state.grammar is None or not state.grammar.done() or state.matcher is not None:
            return None
        exc = state.grammar.exception()
        return None if exc is None else str(exc)

    def rotate_compiling(self, waiting: deque) -> bool:
        """Move waiting requests whose grammar still compiles behind the others, so they wait
        and the rest go ahead; True when the head of `waiting` may be scheduled."""
        for _ in range(len(waiting)):
            if self.is_ready(waiting[0].request_id):
                return True
            waiting.rotate(-1)
        return False

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _matcher(self, state: _RequestState) -> llguidance.LLMatcher | None:
        if state.matcher is None and state.grammar is not None:
            try:
                state.matcher = state.grammar.result().deep_copy()
            except ValueError as exc:  # validated at admission, so this is llguidance's limits
                logger.error("grammar failed to compile: %s; the request ends at its EOS", exc)
                state.grammar = None
        return state.matcher

    def accept_updates(self, updates: list[RequestUpdate]) -> None:
        """After `Scheduler.update`: each constrained request's accepted tokens."""
        for update in updates:
            if update.request_id in self.requests:
                self.accept(update.request_id, [t.token_id for t in update.new_tokens])

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        """Advance the request's matcher (and bad-word history) by its accepted tokens."""
        state = self.requests.get(request_id)
        if state is None or not token_ids:
            return
        matcher = self._matcher(state)
        if matcher is not None and not matcher.is_stopped():
            if not matcher.consume_tokens(token_ids):
                logger.warning("request %s: token outside its grammar: %s", request_id, matcher.get_error())
        if state.bad_words:
            state.history.extend(token_ids)

    # ---- the step's bitmask --------------------------------------------------------------------
    def fill_bitmask(self, scheduled: list[ScheduledRequest]) -> np.ndarray | None:
        """[sampling rows, W] int32 for one step, in the runner's row order (a request with k
        drafts has k + 1 rows). None when no row is constrained."""
        if not self.requests:
            return None
        rows = [(s.request_id, s.token_ids[len(s.token_ids) - s.num_drafts:]) for s in scheduled if s.sample]
        if not any(rid in self.requests for rid, _ in rows):
            return None
        bitmask = np.full((sum(len(d) + 1 for _, d in rows), self.num_words), -1, np.int32)
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        fixed: list[tuple[_RequestState, int, list[int]]] = []
        row = 0
        for rid, drafts in rows:
            state = self.requests.get(rid)
            if state is not None:
                matcher = self._matcher(state)
                if matcher is not None and not matcher.is_error():
                    if drafts:
                        drafted.append((matcher, row, list(drafts)))
                    else:
                        plain.append((matcher, row))
                if state.allowed is not None or state.bad_words:
                    fixed.append((state, row, drafts))
            row += len(drafts) + 1
        if plain:
            llnp.fill_next_token_bitmask_par(self._exec(), plain, bitmask)
        if drafted:  # masks after each draft, matchers rolled back by the library
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self._exec(), drafted, bitmask)
        for state, first, drafts in fixed:
            for j in range(len(drafts) + 1):
                self._apply_fixed(state, bitmask[first + j], state.history + list(drafts[:j]))
        return bitmask

    def _exec(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _apply_fixed(self, state: _RequestState, row: np.ndarray, history: list[int]) -> None:
        if state.allowed is not None:
            row &= state.allowed
        for ids in state.bad_words:
            prefix = ids[:-1]
            if not prefix or history[len(history) - len(prefix):] == prefix:
                banned = ids[-1]
                if banned < self.vocab_size:
                    row.view(np.uint32)[banned // 32] &= ~np.uint32(1 << (banned % 32))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
