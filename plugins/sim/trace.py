"""Request traces for the simulator: one JSON object per line.

=================  ========  ==========================================================
field              required  meaning
=================  ========  ==========================================================
``arrival_time``   yes       seconds since the start of the trace (float, >= 0)
``prompt_len``     yes       prompt tokens (int, >= 1)
``output_len``     yes       tokens the request generates before it stops (int, >= 1)
``priority``       no        lower is served first by ``priority`` (int, default 0)
``prefix_id``      no        requests with the same id share their first ``prefix_len``
                             prompt tokens (a system prompt, a few-shot preamble)
``prefix_len``     no        shared tokens (default: the whole prompt)
``max_tokens``     no        the client's cap, what the scheduler sees (default:
                             ``output_len``, i.e. a perfect output-length estimate)
=================  ========  ==========================================================
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class TraceRequest:
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    prefix_id: str | None = None
    prefix_len: int | None = None
    max_tokens: int | None = None

    def problems(self) -> list[str]:
        out = []
        if self.arrival_time < 0:
            out.append(f"arrival_time must be >= 0, got {self.arrival_time}")
        if self.prompt_len < 1:
            out.append(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            out.append(f"output_len must be >= 1, got {self.output_len}")
        if self.prefix_len is not None and not 0 <= self.prefix_len <= self.prompt_len:
            out.append(f"prefix_len must be in [0, prompt_len={self.prompt_len}], got {self.prefix_len}")
        if self.max_tokens is not None and self.max_tokens < self.output_len:
            out.append(f"max_tokens ({self.max_tokens}) must be >= output_len ({self.output_len})")
        return out


_FIELDS = set(TraceRequest.__dataclass_fields__)
_REQUIRED = {"arrival_time", "prompt_len", "output_len"}


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON-lines trace, sorted by arrival time. Errors name the line."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        missing, unknown = sorted(_REQUIRED - set(row)), sorted(set(row) - _FIELDS)
        if missing or unknown:
            raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}")
        req = TraceRequest(**row)
        problems = req.problems()
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        requests.append(req)
    requests.sort(key=lambda r: r.arrival_time)
    return requests


def save_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for req in requests:
            row = {k: v for k, v in asdict(req).items() if v is not None}
            f.write(json.dumps(row) + "\n")


# ---- synthetic traces -----------------------------------------------------------------------


def _output_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    # Heavy-tailed (Lomax, shape 1.8, scale 100): median ~47, mean ~125, a long tail of
    # multi-thousand-token answers. Capped at 4096.
    return np.clip(rng.pareto(1.8, n) * 100 + 1, 1, 4096).astype(int)


def _prompt_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(300), 0.8, n), 8, 4000).astype(int)


def bursty_trace(num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """Calm periods (15 req/s, mean 20 s) alternating with bursts (120 req/s, mean 4 s),
    heavy-tailed output lengths, 10% high-priority requests (``priority=0``; the rest 1),
    and 40% of prompts opening with one of 4 shared 256-token system prompts."""
    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    t, burst = 0.0, False
    while len(arrivals) < num_requests:
        rate, mean_len = (120.0, 4.0) if burst else (15.0, 20.0)
        end = t + rng.exponential(mean_len)
        while len(arrivals) < num_requests:
            t += rng.exponential(1.0 / rate)
            if t > end:
                t = end
                break
            arrivals.append(t)
        burst = not burst
    prompts = _prompt_lengths(rng, num_requests)
    outputs = _output_lengths(rng, num_requests)
    high = rng.random(num_requests) < 0.1
    shared = rng.random(num_requests) < 0.4
    system = rng.integers(0, 4, num_requests)
    out = []
    for i in range(num_requests):
        req = TraceRequest(round(arrivals[i], 6), int(prompts[i]), int(outputs[i]), priority=0 if high[i] else 1)
        if shared[i]:
            req.prefix_id, req.prefix_len = f"system-{system[i]}", 256
            req.prompt_len += 256
        out.append(req)
    return out


def poisson_trace(num_requests: int, seed: int = 0, rate: float = 30.0) -> list[TraceRequest]:
    """Steady Poisson arrivals at ``rate`` req/s, same length distributions as ``bursty``."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompts = _prompt_lengths(rng, num_requests)
    outputs = _output_lengths(rng, num_requests)
    return [TraceRequest(round(float(a), 6), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


TRACE_KINDS: dict[str, Callable[..., list[TraceRequest]]] = {"bursty": bursty_trace, "poisson": poisson_trace}


def make_trace(kind: str, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(TRACE_KINDS)}")
    return TRACE_KINDS[kind](num_requests, seed)
