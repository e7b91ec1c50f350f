"""The plugin API version: what a plugin declares it was written against, and the rule for
accepting it.

A plugin module (or plugin object) declares ``PAGELM_PLUGIN_API = "MAJOR.MINOR"`` as a
literal string: the version of the contract (hookspecs, the plugin ABCs, the registries) it
was written and tested against. Do not import :data:`PLUGIN_API_VERSION` to declare it: that
would always match. The plugin manager accepts a plugin when

* its MAJOR equals this pagelm's MAJOR (a new major removes or changes hooks or ABC
  methods), and
* its MINOR is at most this pagelm's MINOR (a new minor only adds hooks, optional ABC methods
  with defaults, or registry entries, which an older plugin does not use but a newer one may).

A plugin that declares nothing is loaded with a warning (it predates the declaration).
"""

from __future__ import annotations

import re
from typing import Any

# 1.1 added the pagelm_register_proposers and pagelm_register_structured_output_backends
# hooks and the optional AttentionMetadataBuilder methods (build_for_cudagraph,
# prepare_cudagraph_replay, bind_layers).
# 2.0 split the scheduling-policy contract: the waiting queue is a RequestQueue the policy
# makes (make_queue), the policy ranks (rank) and picks victims (docs/plugins.md, migration).
# 2.1 added StructuredOutputBackend.offload (a GrammarOffload; default None) and
# ProposalBatch.extra_args.
# 2.2 added the pagelm_register_model_loaders hook (ModelLoader, keyed by load_format) and
# the pagelm_register_executors hook (Executor, keyed by distributed_executor_backend).
# 2.3 added the pagelm_register_tool_parsers hook (ToolParser, keyed by the server's
# --tool-call-parser).
# 2.4 added the pagelm_register_stat_loggers hook (StatLogger: Prometheus and the stats log
# left the core), the optional AttentionMetadataBuilder.configure(config), and removed the
# core's cascade notion (docs/plugins.md, migration to 2.4).
# 2.5 moved drafting out of the proposer contract (version 2): the engine calls
# Proposer.propose_step(FinishedStep) and may_draft; propose(ProposalBatch), adaptive drafting
# and the token history are pagelm.plugins.spec_decode.DraftProposer's (docs/plugins.md,
# migration to the proposer contract version 2).
# 2.6 added the pagelm_register_routers hook (Router, keyed by data_parallel_router) and the
# pipeline-parallel model interface (forward's intermediate_tensors,
# make_empty_intermediate_tensors, supports_pipeline_parallel; optional).
# 2.7 added the pagelm_register_kv_offload hook (KVOffload: a CPU tier for swap preemption
# and prefix spill, keyed by kv_offload) and SchedulerOutput.kv_transfers.
# 2.8 added the multimodal contract (pagelm.multimodal: SupportsMultiModal, a model's
# MultiModalProcessor, MultiModalFeature) and the optional inputs_embeds argument of a model's
# forward (docs/plugins.md, migration to 2.8).
# 2.9 added a vision-language model's own rotary positions (M-RoPE): the optional
# SupportsMultiModal.position_rows and get_input_positions, and pagelm.multimodal.RequestPositions
# (docs/plugins.md, migration to 2.9).
PLUGIN_API_VERSION = "2.9"
PLUGIN_API_ATTRIBUTE = "PAGELM_PLUGIN_API"

_VERSION_RE = re.compile(r"^(\d+)(?:\.(\d+))?$")


def parse_api_version(value: Any) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; ``"1"`` or ``1`` -> ``(1, 0)``. ``ValueError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, 0
    match = _VERSION_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{PLUGIN_API_ATTRIBUTE} must look like 'MAJOR.MINOR' (e.g. '1.0'), got {value!r}")
    return int(match.group(1)), int(match.group(2) or 0)


def declared_api_version(plugin: Any) -> str | None:
    value = getattr(plugin, PLUGIN_API_ATTRIBUTE, None)
    return None if value is None else str(value)


def api_incompatibility(declared: Any, provided: str = PLUGIN_API_VERSION) -> str | None:
    """Why a plugin declaring ``declared`` cannot run on plugin API ``provided`` (None: it can)."""
    try:
        major, minor = parse_api_version(declared)
    except ValueError as exc:
        return str(exc)
    have_major, have_minor = parse_api_version(provided)
    if major != have_major:
        return (
            f"it declares plugin API {declared}, but this pagelm provides plugin API {provided} "
            f"(major versions differ); use a release of the plugin made for plugin API {have_major}.x"
        )
    if minor > have_minor:
        return (
            f"it declares plugin API {declared}, newer than this pagelm's plugin API {provided}; "
            f"upgrade pagelm or use an older release of the plugin"
        )
    return None
