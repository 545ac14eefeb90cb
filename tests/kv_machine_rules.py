"""The free / swap-out / swap-in rules the KV manager state machines share (tests/test_kv_cache_manager.py,
tests/test_hybrid_kv_cache.py): a machine holding `kv` (a manager), `tokens` and `computed` per request,
the shadow `dev` / `cpu` blocks and the `swapped` set, with `_on_device()` naming its requests on the device."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule


class FreeAndSwapRules:
    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.forget(rid)
        del self.tokens[rid], self.computed[rid]
        self.swapped.discard(rid)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._on_device()))
        pairs = self.kv.swap_out(rid)
        if pairs is not None:
            for d, c in pairs:
                self.cpu[c] = list(self.dev[d])
            self.swapped.add(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        pairs = self.kv.swap_in(rid, self.computed[rid], 1)
        if pairs is not None:
            for c, d in pairs:
                self.dev[d] = list(self.cpu[c])
            self.swapped.discard(rid)
