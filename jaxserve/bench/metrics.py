"""Latency arithmetic shared by every `jaxserve bench` subcommand: percentiles, TPOT, goodput.

Per request (all times in seconds, relative to when the request was sent):

    sent ──ttft──> 1st token ──itl[0]──> 2nd ──itl[1]──> ... ──> last token (= e2el)
    tpot = (e2el - ttft) / (output_len - 1)      only for output_len > 1

Percentiles use numpy's default (linear interpolation between closest ranks), as
vLLM's `vllm bench serve` does, so numbers are comparable. Result field names
follow vLLM's result JSON ("mean_ttft_ms", "p99_itl_ms", "request_goodput", ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
DEFAULT_PERCENTILES = (99.0,)


@dataclass
class RequestResult:
    """What one request produced, as seen by the client."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # tokens: the server's usage count, else the streamed chunks
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    latency: float = 0.0  # end to end, seconds
    start_time: float = 0.0  # time.perf_counter() when sent
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; 0.0 for no values (vLLM's convention)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else 0.0


def summarize(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """`mean_/median_/std_/pXX_{name}_ms` from values in seconds."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()) if arr.size else 0.0,
           f"median_{name}_ms": float(np.median(arr)) if arr.size else 0.0,
           f"std_{name}_ms": float(arr.std()) if arr.size else 0.0}
    for q in percentiles:
        out[f"p{format_percentile(q)}_{name}_ms"] = percentile(arr, q)
    return out


def format_percentile(q: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(q)) if float(q).is_integer() else str(q)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds); ValueError names the bad item."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"goodput: {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A successful request whose every given SLO holds (TPOT of a 1-token output counts as 0)."""
    if not result.success:
        return False
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(values[name] * 1000.0 <= ms for name, ms in slos_ms.items())


def calculate_metrics(results: list[RequestResult], duration: float, *,
                      percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
                      percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
                      goodput_slos_ms: dict[str, float] | None = None) -> dict[str, object]:
    """The aggregate result dict (vLLM field names) of one benchmark run lasting `duration` seconds."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    duration = max(duration, 1e-9)
    out: dict[str, object] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput_slos_ms:
        out["request_goodput"] = sum(meets_slos(r, goodput_slos_ms) for r in ok) / duration
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in METRICS:
        # Every metric is summarized (the JSON keeps them all); percentile_metrics picks what is printed.
        out.update(summarize(name, series[name], percentiles))
    out["max_output_tokens_per_s"] = _peak_tokens_per_s(ok)
    out["percentile_metrics"] = list(percentile_metrics)
    out["metric_percentiles"] = [float(q) for q in percentiles]
    return out


def _peak_tokens_per_s(results: list[RequestResult]) -> float:
    """The most output tokens seen in any one-second window of wall clock (vLLM's max_output_tokens_per_s)."""
    times: list[float] = []
    for r in results:
        t = r.start_time + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    if not times:
        return 0.0
    start = min(times)
    counts = np.bincount(np.floor(np.asarray(times) - start).astype(int))
    return float(counts.max())
