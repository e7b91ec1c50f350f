"""``prefix_affinity``: send a request to the replica whose KV cache most likely holds the
longest prefix of its prompt, so shared prefixes (system prompts, few-shot examples, the
turns of one conversation) are computed on one replica and hit its prefix cache instead of
being computed again on every replica.

The router keeps, per replica, the chained hashes of the full prompt blocks it has sent
there (an LRU bounded by ``plugin_config["prefix_affinity_max_blocks"]``, default 65536
per replica), as the engine's prefix cache chains them: a block's hash covers every token
before it, so a prompt's match on a replica is its run of leading blocks found there. A
request goes to the replica with the longest match unless that replica holds more than
``plugin_config["prefix_affinity_max_imbalance"]`` (default 8) unfinished requests beyond
the least-loaded one; without a match, or past that bound, to the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagelm.plugins.routers.balance import least_loaded
from pagelm.plugins.routers.router import ReplicaLoad, Router


class PrefixAffinityRouter(Router):
    name = "prefix_affinity"

    def __init__(self, config, num_replicas: int) -> None:
        super().__init__(config, num_replicas)
        self.block_size = config.block_size
        self.max_blocks = int(config.plugin_config.get("prefix_affinity_max_blocks", 65536))
        self.max_imbalance = int(config.plugin_config.get("prefix_affinity_max_imbalance", 8))
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    @classmethod
    def validate(cls, config) -> list[str]:
        problems = []
        for key, low in (("prefix_affinity_max_blocks", 1), ("prefix_affinity_max_imbalance", 0)):
            value = config.plugin_config.get(key)
            if value is not None and not (isinstance(value, int) and value >= low):
                problems.append(f"plugin_config[{key!r}] must be an int >= {low}, got {value!r}")
        return problems

    def block_hashes(self, request) -> list[int]:
        """Chained hashes of the prompt's full blocks (the cache salt seeds the chain)."""
        ids, bs = request.prompt_token_ids, self.block_size
        parent, out = hash(("pagelm-prefix", request.cache_salt)), []
        for start in range(0, len(ids) - bs + 1, bs):
            parent = hash((parent, tuple(ids[start : start + bs])))
            out.append(parent)
        return out

    def _match(self, replica: int, hashes: list[int]) -> int:
        seen, n = self._blocks[replica], 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def route(self, request, loads: Sequence[ReplicaLoad]) -> int:
        hashes = self.block_hashes(request)
        floor = min(load.num_unfinished for load in loads)
        eligible = [i for i, load in enumerate(loads) if load.num_unfinished <= floor + self.max_imbalance]
        matches = {i: self._match(i, hashes) for i in eligible}
        best = max(matches.values(), default=0)
        choice = least_loaded(loads, [i for i in eligible if matches[i] == best] if best else None)
        self._remember(choice, hashes)
        return choice

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self._blocks[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
