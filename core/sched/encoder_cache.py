"""The encoder cache manager: which images' embeddings the runner holds (keyed by the image's
``identifier``, counted in embeddings), on the scheduler's side (``docs/multimodal.md``)::

    allocate / take_ref    ->  referenced  --release (last position computed, or preempted)-->
    freeable (still a hit) --evicted for room-->  gone (its identifier goes to the runner
                                                  in the next SchedulerOutput, which drops it)

and, per ``schedule()`` (``begin_step`` .. ``end_step``), which images a chunk of a multimodal
request may take under the step's encoder budget and who encodes each.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagelm.request import Request


@dataclass
class EncoderCacheStats:
    queries: int = 0  # images looked up when a request first needed them
    hits: int = 0  # of those, found encoded (or being encoded this step)


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size  # in embeddings
        self.num_free_slots = cache_size  # not held by any entry, referenced or freeable
        self.sizes: dict[str, int] = {}  # identifier -> embeddings, every entry
        self.refs: dict[str, set[str]] = {}  # identifier -> request ids holding it (non-empty)
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries, LRU first
        self.num_freeable = 0  # embeddings in freeable entries
        self.req_refs: dict[str, set[str]] = {}  # request id -> identifiers it holds
        self.evicted: list[str] = []  # since the runner was last told
        self.stats = EncoderCacheStats()
        self.begin_step(0)

    # ---- lookups -------------------------------------------------------------------------
    def holds(self, request_id: str, identifier: str) -> bool:
        return identifier in self.req_refs.get(request_id, ())

    def take_ref(self, request_id: str, identifier: str) -> bool:
        """A hit: ``request_id`` now holds the cached entry. False (and nothing changes) when
        there is no entry: the encoder must run (``allocate``)."""
        if identifier not in self.sizes:
            return False  # the miss is counted by allocate(), once it is served
        self.stats.queries += 1
        self.stats.hits += 1
        self._ref(request_id, identifier)
        return True

    # ---- changes -------------------------------------------------------------------------
    def allocate(self, request_id: str, identifier: str, size: int) -> None:
        """A miss: room for ``identifier``'s ``size`` embeddings (the runner encodes it this
        step), evicting least recently released entries first. The caller has checked that
        ``size <= num_free_slots + num_freeable``."""
        assert identifier not in self.sizes, f"{identifier} is cached already"
        while self.num_free_slots < size:
            self._drop(next(iter(self.freeable)), evicted=True)
        self.stats.queries += 1
        self.num_free_slots -= size
        self.sizes[identifier] = size
        self._ref(request_id, identifier)

    def release(self, request_id: str, identifier: str) -> None:
        """``request_id`` needs ``identifier`` no more (its last position is computed)."""
        self.req_refs[request_id].discard(identifier)
        if not self.req_refs[request_id]:
            del self.req_refs[request_id]
        holders = self.refs[identifier]
        holders.discard(request_id)
        if not holders:
            del self.refs[identifier]
            self.freeable[identifier] = self.sizes[identifier]
            self.num_freeable += self.sizes[identifier]

    def free(self, request_id: str) -> None:
        """Release everything ``request_id`` holds (it finished or was preempted)."""
        for identifier in list(self.req_refs.get(request_id, ())):
            self.release(request_id, identifier)

    def forget(self, identifier: str) -> None:
        """Drop an unreferenced entry outright: it was allocated this step and nobody
        encodes it after all (its request gave way in the same step)."""
        if identifier in self.freeable:
            self._drop(identifier, evicted=False)

    def evict_all(self) -> None:
        """Evict every unreferenced entry (after a failed step, whose encodes may be missing)."""
        for identifier in list(self.freeable):
            self._drop(identifier, evicted=True)

    def take_evicted(self) -> list[str]:
        """Identifiers evicted since the last call: the runner drops their embeddings."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def usage(self) -> float:
        """Share of the cache referenced by requests (freeable entries count as free)."""
        used = self.cache_size - self.num_free_slots - self.num_freeable
        return used / self.cache_size if self.cache_size else 0.0

    # ---- one scheduler step --------------------------------------------------------------
    def begin_step(self, budget: int) -> None:
        self.step_budget = budget  # embeddings the encoder may still make this step
        # Images allocated this step, and those a scheduled request encodes.
        self.step_new: set[str] = set()
        self.step_assigned: set[str] = set()

    def plan(self, req: "Request", start: int, num_new: int) -> tuple[int, list]:
        """The images the tokens ``[start, start + num_new)`` touch that ``req`` does not hold
        yet; an image that is not cached and does not fit this step's encoder budget or the
        cache cuts the chunk short before its first placeholder::

            | computed | text  img img img | img img ...     <- no room to encode this one
                       ^start              ^ returned num_new ends here

        Returns ``(num_new, images to take)``; nothing changes until ``commit``."""
        end = start + num_new
        wanted, budget = [], self.step_budget
        room = self.num_free_slots + self.num_freeable  # a hit on a freeable entry takes it out
        for feature in req.mm_features:
            if feature.offset >= end:
                break
            if feature.end <= start or self.holds(req.request_id, feature.identifier):
                continue
            if feature.identifier in self.freeable:  # a hit that takes room misses could evict
                if self.freeable[feature.identifier] > room:
                    return max(feature.offset - start, 0), wanted
                room -= self.freeable[feature.identifier]
            elif feature.identifier not in self.sizes:
                if feature.length > min(budget, room):
                    return max(feature.offset - start, 0), wanted
                budget -= feature.length
                room -= feature.length
            wanted.append(feature)
        return num_new, wanted

    def commit(self, req: "Request", wanted: list) -> None:
        """Take what ``plan`` chose: hits hold their cached entries first (so that no miss
        evicts them), then each miss allocates room (the runner encodes it this step)."""
        misses = [f for f in wanted if not self.take_ref(req.request_id, f.identifier)]
        for feature in misses:
            if not self.take_ref(req.request_id, feature.identifier):  # else: a copy of an image just allocated
                self.allocate(req.request_id, feature.identifier, feature.length)
                self.step_budget -= feature.length
                self.step_new.add(feature.identifier)

    def assign_encodes(self, req: "Request", start: int, num_new: int) -> list[int]:
        """Indices into ``req.mm_features`` of the images allocated this step that its tokens
        ``[start, start + num_new)`` touch and nobody encodes yet (the request that allocated
        one may have given way since): ``req`` encodes them."""
        indices = []
        for index, feature in enumerate(req.mm_features):
            unassigned = feature.identifier in self.step_new and feature.identifier not in self.step_assigned
            if unassigned and feature.overlaps(start, start + num_new):
                self.step_assigned.add(feature.identifier)
                indices.append(index)
        return indices

    def release_computed(self, req: "Request") -> None:
        """``req`` holds an image only while one of its copies is partly computed: an image
        whose positions are done (or not begun) is released, so that a request never waits
        for cache room while holding any (an image repeated later is looked up again)."""
        computed = req.num_computed_tokens
        in_progress = {f.identifier for f in req.mm_features if f.offset < computed < f.end}
        for feature in req.mm_features:
            if feature.identifier not in in_progress and self.holds(req.request_id, feature.identifier):
                self.release(req.request_id, feature.identifier)

    def end_step(self) -> list[str]:
        """Drop the images allocated this step that nobody encodes (their request gave way),
        and return the identifiers evicted since the last step: the runner drops those."""
        for identifier in self.step_new - self.step_assigned:
            self.forget(identifier)
        return self.take_evicted()

    def _drop(self, identifier: str, evicted: bool) -> None:
        """Remove an unreferenced entry; ``evicted``: the runner may hold its embeddings, so
        the next ``SchedulerOutput`` tells it to drop them."""
        size = self.freeable.pop(identifier)
        del self.sizes[identifier]
        self.num_freeable -= size
        self.num_free_slots += size
        if evicted:
            self.evicted.append(identifier)

    def _ref(self, request_id: str, identifier: str) -> None:
        size = self.freeable.pop(identifier, None)
        if size is not None:
            self.num_freeable -= size
        self.refs.setdefault(identifier, set()).add(request_id)
        self.req_refs.setdefault(request_id, set()).add(identifier)
