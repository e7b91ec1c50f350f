"""Speculative decoding in tests: a test's own proposer registered for the length of a
``with`` block, as a third-party plugin would be (``pagelm_register_proposers``); and a count
of how an engine's steps were launched."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagelm import hookimpl
from pagelm.plugin_manager import get_plugin_manager


@contextmanager
def registered_proposer(proposer_cls) -> Iterator[None]:
    """``speculative_config={"method": proposer_cls.name}`` works inside the block."""

    class Plugin:
        @hookimpl
        def pagelm_register_proposers(self, registry):
            registry.add(proposer_cls.name, proposer_cls)

    name = f"test-proposer-{proposer_cls.name}"
    get_plugin_manager().register(Plugin(), name=name)
    try:
        yield
    finally:
        get_plugin_manager().unregister(name=name)


def count_launches(core) -> dict[str, int]:
    """Wrap ``core.runner.launch`` to count, from now on, the steps launched while the
    previous one was still in flight (``"ahead"``: async scheduling) and the steps that
    verify drafts (``"verify"``). Returns the live counts."""
    counts = {"ahead": 0, "verify": 0}
    launch = core.runner.launch

    def counting(sched, **kwargs):
        counts["ahead"] += core.runner._in_flight is not None
        counts["verify"] += bool(sched.scheduled_spec_decode_tokens)
        return launch(sched, **kwargs)

    core.runner.launch = counting
    return counts
