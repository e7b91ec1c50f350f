"""``speculative_config``: which proposer drafts tokens, and how many per step.

Given as a plain mapping (``LLM(..., speculative_config={...})``, ``--speculative-config JSON``,
a YAML key) with vLLM's names::

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "eagle", "num_speculative_tokens": 3, "model": "/path/to/eagle-head"}
    {"method": "medusa", "num_speculative_tokens": 3, "model": "/path/to/medusa-heads"}

and, for any method, adaptive drafting (``pagelm.spec_decode.backoff``): ``"adaptive"``
(default true), ``"backoff_after"`` misses in a row before a request stops drafting (default
2), ``"max_backoff_steps"`` the longest pause between its probes (default 128).

Shapes and types are checked here, with the rest of the engine config; whether ``method`` is
registered, and what that proposer needs (``model`` for EAGLE and Medusa), is checked at engine
start-up, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_KNOWN = (
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
    "adaptive", "backoff_after", "max_backoff_steps",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram (prompt lookup): longest and shortest suffix to look up (vLLM's defaults: 5 and 5).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Draft model directory (EAGLE head, Medusa heads).
    model: str | None = None
    # Adaptive drafting: a request whose drafts miss ``backoff_after`` verifications in a row
    # stops drafting, probing again after 2, 4, ... up to ``max_backoff_steps`` steps (a
    # probe drafts one token; 128: a drafter that never pays costs a probe per 128 steps).
    adaptive: bool = True
    backoff_after: int = 2
    max_backoff_steps: int = 128
    # Other keys, for third-party proposers (they check them in ``Proposer.validate``).
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Any) -> "SpeculativeConfig":
        """Parse and check the mapping; ``ValueError`` names the offending key."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(raw).__name__}")
        method = raw.get("method")
        if not isinstance(method, str) or not method:
            raise ValueError(f"speculative_config.method must name a proposer (e.g. 'ngram', 'eagle'), got {method!r}")
        _check_positive_int("num_speculative_tokens", raw.get("num_speculative_tokens"))
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if raw.get(name) is not None:
                _check_positive_int(name, raw[name])
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config.model must be a path, got {model!r}")
        if not isinstance(raw.get("adaptive", True), bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {raw['adaptive']!r}")
        for name in ("backoff_after", "max_backoff_steps"):
            _check_positive_int(name, raw.get(name, 1))
        return cls(
            **{key: raw[key] for key in _KNOWN if key in raw},
            options={key: value for key, value in raw.items() if key not in _KNOWN},
        )

    def describe(self) -> str:
        if not self.adaptive:
            return f"{self.method}(k={self.num_speculative_tokens}, adaptive off)"
        return (
            f"{self.method}(k={self.num_speculative_tokens}, backoff after {self.backoff_after} misses, "
            f"up to {self.max_backoff_steps} steps)"
        )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
