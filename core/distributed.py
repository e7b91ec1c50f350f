"""Parallel state: which rank this process is, of how many, and the collectives the parallel
layers and the pipeline stages call (``pagelm.models.layers``, the model runner).

One process per rank. Rank 0 runs the engine core (scheduler, KV cache manager and its own
model runner); an executor (``pagelm.executor``) starts the others. Every rank holds the
same config and runs the same runner calls in the same order, so its collectives meet the
others' inside the model. Collectives go through ``torch.distributed``: NCCL on CUDA, gloo
on the CPU (how CI tests scale-out). With one rank nothing is initialised and the
collectives return their input. A small all-reduce on CUDA (a decode step's [tokens, hidden])
goes through torch's symmetric memory instead of NCCL: each rank reads the others' buffers
over NVLink in one kernel (8.6 us against NCCL's 14.7 us per 8 KiB inside a CUDA graph on two
H100s; 64 of them per Llama-8B decode step). At batch 1 over two ranks the row-parallel
projections go further and exchange their partial sums inside their own GEMV
(``fused_all_reduce_buffers``). ``disable_custom_all_reduce`` turns both off.

Ranks are laid out stage-major: rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline
stage ``r // tp``, so the ``tp`` ranks of a stage are neighbours (one host's GPUs) and rank
0 is stage 0's first rank::

    tp=2, pp=2:   stage 0: ranks 0 1  --hidden, residual-->  stage 1: ranks 2 3 (norm, LM head, sampling)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import logging
import os
import threading
import warnings

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# All-reduces of at most this many bytes take the symmetric-memory path (above it NCCL's
# bandwidth wins or the gain is small: 37 against 41 us at 4 MiB).
SYMM_MEM_MAX_BYTES = 512 * 1024
# Seconds shutdown waits for NCCL's destroy_process_group (see destroy_distributed).
TEARDOWN_TIMEOUT = 10.0
# The all-reduce of a batch-1 row-parallel projection done inside its GEMV (two ranks,
# symmetric memory; ``fused_all_reduce_buffers``), for outputs up to this many elements.
# ``PAGELM_FUSED_ALL_REDUCE=0`` (read when a world is joined) keeps it a kernel of its own.
FUSED_ALL_REDUCE_MAX_ELEMENTS = 16384


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # The process group of this stage's tensor-parallel ranks (None: the default group,
    # which is the same set when there is one stage).
    tp_group: Any = None

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_rank(self) -> int:
        """The rank whose sampled ids every rank takes: the last stage's first rank."""
        return (self.pp_size - 1) * self.tp_size


_state = ParallelState()
# Whether init_distributed created the default process group (else it adopted the one this
# process had, e.g. torchrun's script's: destroy_distributed leaves that one alone).
_owns_group = False


def parallel_state() -> ParallelState:
    return _state


# dtype -> this rank's symmetric-memory buffer (made on first use, in the eager profile run
# that comes before any CUDA graph is captured); None: the path is off or unavailable.
_symm_buffers: dict[torch.dtype, torch.Tensor] | None = None
# (dtype, site) -> (capacity, the buffers of ``fused_all_reduce_buffers``), or None where they
# could not be made (made on first use, like _symm_buffers); whether this world fuses at all.
_fused_buffers: dict[tuple[torch.dtype, int], tuple[int, tuple[torch.Tensor, torch.Tensor]] | None] = {}
_fused_all_reduce = False
# Symmetric-memory rendezvous this process has tried, over every world it joined (torch keeps
# its own count, which no teardown resets: see _symm_histories_agree).
_symm_rendezvous_count = 0


def init_distributed(
    rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device, timeout: float,
    custom_all_reduce: bool = True,
) -> None:
    """Join the ranks' process group (blocks until all ``tp_size * pp_size`` have joined); a
    collective waiting longer than ``timeout`` seconds raises. A process whose
    ``torch.distributed`` is initialised already (a ``torchrun`` script that called
    ``init_process_group``) keeps that world, which must be this one."""
    global _state, _symm_buffers, _owns_group, _fused_all_reduce
    world_size = tp_size * pp_size
    tp_group = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # a bare "cuda" (rank 0's default) is the current device
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise ValueError(
                    f"torch.distributed is initialised as rank {dist.get_rank()} of {dist.get_world_size()}; "
                    f"this engine needs rank {rank} of tensor_parallel_size x pipeline_parallel_size = {world_size}"
                )
        else:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
            _owns_group = True
        if pp_size > 1 and tp_size > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for stage in range(pp_size):
                group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                if stage == rank // tp_size:
                    tp_group = group
    _state = ParallelState(rank % tp_size, tp_size, rank // tp_size, pp_size, tp_group)
    symm = custom_all_reduce and tp_size > 1 and device.type == "cuda"
    _symm_buffers = {} if symm and _symm_histories_agree(device) else None
    _fused_buffers.clear()
    _fused_all_reduce = os.environ.get("PAGELM_FUSED_ALL_REDUCE", "1").lower() not in ("0", "false", "off", "no")


def destroy_distributed() -> None:
    """Leave the process group. A world this process had before ``init_distributed`` (a
    ``torchrun`` script's) is left initialised: only the stage group made here goes.

    NCCL's teardown is waited on for at most ``TEARDOWN_TIMEOUT`` seconds: on two H100s both
    ranks of a TP=2 engine waited forever inside ``destroy_process_group`` (torch 2.11) while
    CUDA graphs that captured its all-reduce were alive (with ``enforce_eager`` it returned),
    so the ranks release their graphs first (``ModelRunner.release_cuda_graphs``); a teardown
    that still hangs is given up on (the process group is left behind; a later engine in this
    process cannot join one)."""
    global _state, _symm_buffers, _owns_group
    _symm_buffers = None
    _fused_buffers.clear()
    if dist.is_initialized():
        if not _owns_group:
            if _state.tp_group is not None:
                dist.destroy_process_group(_state.tp_group)
        elif dist.get_backend() == "nccl":
            teardown = threading.Thread(target=dist.destroy_process_group, name="pagelm-nccl-teardown", daemon=True)
            teardown.start()
            teardown.join(TEARDOWN_TIMEOUT)
            if teardown.is_alive():
                logger.warning("NCCL's destroy_process_group did not return in %.0f s; shutdown goes on without it",
                               TEARDOWN_TIMEOUT)
        else:
            dist.destroy_process_group()
    _state, _owns_group = ParallelState(), False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over this stage's tensor-parallel ranks: ``x`` itself, summed in place,
    or (the symmetric-memory path) a new tensor; use the returned one."""
    if _state.tp_size == 1:
        return x
    if _symm_buffers is not None and x.numel() * x.element_size() <= SYMM_MEM_MAX_BYTES and x.is_contiguous():
        buffer = _symm_buffers.get(x.dtype)
        if buffer is None:
            buffer = _symm_buffer(x.dtype, x.device)
        if buffer is not None:
            # One kernel: x is copied into this rank's buffer, then every rank sums all buffers.
            return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[: x.numel()].view_as(x), x, "sum", _group_name())
    dist.all_reduce(x, group=_state.tp_group)
    return x


def fused_all_reduce_buffers(site: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(send, recv)`` for a batch-1 projection of ``n`` outputs that sums them over the two
    tensor-parallel ranks itself (``gemv(all_reduce=...)`` in
    ``pagelm.backends.kernels.gemv``): ``send`` is the other rank's receive buffer, mapped
    here through symmetric memory, ``recv`` this rank's. None: the all-reduce stays a kernel
    of its own (not two ranks, symmetric memory off or unavailable, an output wider than
    the site's buffer).

    ``site`` picks a buffer. Two consecutive exchanges must not share one (a rank may write
    its next tile as soon as it is past an exchange, before the other has read it), so a
    decoder layer's o_proj uses site 0 and its down_proj site 1: the exchanges alternate
    through every layer, step after step. A site's buffer is made on its first call, for
    ``max(n, FUSED_ALL_REDUCE_MAX_ELEMENTS)`` outputs: a collective (every rank makes the
    same calls in the same order)."""
    if _state.tp_size != 2 or _symm_buffers is None or not _fused_all_reduce:
        return None
    if (dtype, site) not in _fused_buffers:
        capacity = max(n, FUSED_ALL_REDUCE_MAX_ELEMENTS)
        buffers = _make_fused_buffers(dtype, capacity)
        _fused_buffers[(dtype, site)] = None if buffers is None else (capacity, buffers)
    made = _fused_buffers[(dtype, site)]
    return None if made is None or made[0] < n else made[1]


def _make_fused_buffers(dtype: torch.dtype, capacity: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One site's buffers: a symmetric allocation per rank of 4 bytes per output (the
    exchange sends two 16-bit values and a flag in each 64-bit word), and a little more for
    a last tile past the outputs, zero before the other rank can see it."""
    global _symm_rendezvous_count
    data_bytes = 4 * (capacity + 64)
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
                symm_mem.enable_symm_mem_for_group(_group_name())
            local = symm_mem.empty(data_bytes, dtype=torch.uint8, device=device)
            local.zero_()
            torch.cuda.synchronize(device)
            _symm_rendezvous_count += 1
            handle = symm_mem.rendezvous(local, _group_name())
        send = handle.get_buffer(1 - handle.rank, (data_bytes // dtype.itemsize,), dtype)
    except Exception as e:  # no P2P between the GPUs, an old torch: a kernel of its own
        logger.warning("fused all-reduce unavailable (%s); the all-reduce stays a kernel of its own", e)
        return None
    return send, local.view(dtype)


def _group_name() -> str:
    return (_state.tp_group or dist.group.WORLD).group_name


def _symm_histories_agree(device: torch.device) -> bool:
    """Whether every rank's process has made as many symmetric-memory rendezvous before this
    world as this one (a collective). torch numbers a process's rendezvous and its store keys
    carry the number, so rank 0 that served an earlier TP engine and freshly started ranks
    would wait on different keys until the distributed timeout (seen on two H100s: a second
    TP=2 engine in one process stalled 300 s, then fell back to NCCL). If they differ, NCCL
    serves every all-reduce of this world."""
    least = min_over_ranks(_symm_rendezvous_count, device)
    if least == -min_over_ranks(-_symm_rendezvous_count, device):
        return True
    logger.info(
        "symmetric-memory all-reduce off for this engine: a rank's process made symmetric memory for an "
        "earlier engine, so the ranks' rendezvous would not meet; NCCL for every all-reduce"
    )
    return False


def _symm_buffer(dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """This rank's buffer for ``dtype``, made and exchanged with the other ranks (a collective:
    every rank reaches it at the same all-reduce). None, and NCCL from then on, where this
    torch or machine has no symmetric memory."""
    global _symm_buffers, _symm_rendezvous_count
    try:
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
                symm_mem.enable_symm_mem_for_group(_group_name())
            buffer = symm_mem.empty(SYMM_MEM_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
            _symm_rendezvous_count += 1  # counted when tried: torch numbers a failed one too
            symm_mem.rendezvous(buffer, _group_name())
    except Exception as e:  # an old torch, no P2P between the GPUs: NCCL serves every size
        logger.warning("symmetric-memory all-reduce unavailable (%s); NCCL for every all-reduce", e)
        _symm_buffers = None
        return None
    _symm_buffers[dtype] = buffer
    return buffer


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This stage's tensor-parallel ranks' ``x`` concatenated along ``dim``, in rank order.
    Gathered into one ``[tp, *x.shape]`` tensor and moved into place: a view when every dim
    before ``dim`` has size 1 (a batch-1 decode step's logits), one copy otherwise (a list
    of parts and ``torch.cat`` cost NCCL's copy-out of each part and the cat's copy)."""
    if _state.tp_size == 1:
        return x
    x = x.contiguous()
    # Concatenated along dim 0 (the layout every backend takes, gloo too), read as stacked.
    out = torch.empty((_state.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=_state.tp_group)
    out = out.view(_state.tp_size, *x.shape)
    dim = dim % x.dim()
    shape = (*x.shape[:dim], _state.tp_size * x.shape[dim], *x.shape[dim + 1 :])
    return out.movedim(0, dim).reshape(shape)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The least ``value`` over every rank of the engine (all stages): a collective."""
    if _state.tp_size * _state.pp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ---- pipeline stages ------------------------------------------------------------------------
# A stage's output is a dict of named tensors (the model's "intermediate tensors": hidden
# states and residual for the built-in models). Each rank sends to the rank of the same
# tensor-parallel index in the next stage; the receiver knows the shapes from the model
# (``make_empty_intermediate_tensors``) and the step's token count, so only data travels.


def send_to_next_stage(tensors: dict[str, torch.Tensor]) -> list:
    """Start sending (non-blocking: this stage goes on with the next micro-batch); returns
    the work handles, to wait on (and keep the tensors alive) until the step is finished."""
    dst = _state.rank + _state.tp_size
    return [(dist.isend(tensors[name].contiguous(), dst), tensors[name]) for name in sorted(tensors)]


def recv_from_previous_stage(empty: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill ``empty`` (tensors of the right shapes) with the previous stage's output."""
    src = _state.rank - _state.tp_size
    for name in sorted(empty):
        dist.recv(empty[name], src)
    return empty


def broadcast_from_last_stage(x: torch.Tensor) -> torch.Tensor:
    """The last stage's ``x`` on every rank (the step's sampled ids: every runner keeps its
    copy of each request's tokens in step, and rank 0's scheduler reads them)."""
    dist.broadcast(x, _state.last_stage_rank)
    return x


def last_stage_to_rank0(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The last stage's ``tensors`` on rank 0 (results only the engine core reads: logprobs,
    prompt logprobs); rank 0 passes empty tensors of the right shapes and dtypes, which are
    filled. The last stage's first rank sends; every other rank passes through."""
    if _state.rank == _state.last_stage_rank:
        for t in tensors:
            dist.send(t.contiguous(), 0)
    elif _state.rank == 0:
        for t in tensors:
            dist.recv(t, _state.last_stage_rank)
    return tensors
