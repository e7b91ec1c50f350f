"""A stand-in for the ``flashinfer`` package on machines without a GPU: the three wrappers and
``merge_state_in_place`` pagelm uses, with FlashInfer 0.5.3's signatures (a misspelt keyword
fails here as it would there) and its semantics, in plain torch.

What it mirrors, so the CPU tests check the backend's planning against it:

* ``plan`` takes int32 page tables (``indptr``, ``indices``, ``last_page_len``); in CUDA-graph
  mode it copies them into the fixed buffers given at construction, and ``run`` reads only
  those buffers (what a captured kernel would see), never the arguments of the last plan;
* the causal mask is aligned to the end of each row's KV (query ``j`` of ``qo_len`` sees keys
  up to ``kv_len - qo_len + j``); ``window_left = w`` keeps keys at most ``w`` positions back;
* ``run(..., return_lse=True)`` also returns the log-sum-exp of the scaled logits, and
  ``merge_state_in_place`` merges two partial states.

It also insists that ``indptr`` and ``last_page_len`` arrive on the host (the real ``plan``
copies them to the host otherwise: a device sync per step).
"""

from __future__ import annotations

import torch

__version__ = "0.5.3+fake"


def _check_int32(**tensors):
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")


def _unpack(paged_kv_cache, kv_layout):
    assert kv_layout == "NHD"
    if isinstance(paged_kv_cache, tuple):
        return paged_kv_cache
    assert paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2, paged_kv_cache.shape
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


class _PagedAttention:
    """State shared by both wrappers: the planned page tables and the attention math."""

    def _init(self, float_workspace_buffer, kv_layout, use_cuda_graph, indptr_buf, indices_buf, last_buf, qo_buf):
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            for name, buf in (("indptr", indptr_buf), ("indices", indices_buf), ("last_page_len", last_buf)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"paged_kv_{name} buffer should be a torch.Tensor in cudagraph mode")
        self._paged_kv_indptr_buf = indptr_buf
        self._paged_kv_indices_buf = indices_buf
        self._paged_kv_last_page_len_buf = last_buf
        self._qo_indptr_buf = qo_buf
        self.num_plans = 0
        self.int_workspace = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        self.int_workspace = int_workspace_buffer

    def _store_plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                    page_size, causal, window_left, sm_scale, q_data_type, kv_data_type, logits_soft_cap):
        _check_int32(indptr=indptr, indices=indices, last_page_len=last_page_len)
        # pagelm keeps these on the host: FlashInfer reads them there to plan.
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu", "plan would sync the device"
        assert qo_indptr.device.type == "cpu"
        assert num_qo_heads % num_kv_heads == 0
        assert len(indptr) == len(last_page_len) + 1 == len(qo_indptr)
        assert int(indptr[-1]) == len(indices), "indices must hold exactly indptr[-1] pages"
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()
        if self._use_cuda_graph:
            if len(last_page_len) != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
            if torch.is_tensor(self._qo_indptr_buf):  # a prefill wrapper's fixed buffer, as FlashInfer's
                self._qo_indptr_buf.copy_(qo_indptr)
            else:
                self._qo_indptr_buf = qo_indptr.to(self.device)
        else:
            self._paged_kv_indptr_buf = indptr.to(self.device)
            self._paged_kv_indices_buf = indices.to(self.device)
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device)
            self._qo_indptr_buf = qo_indptr.to(self.device)
        self._num_qo_heads, self._num_kv_heads, self._head_dim, self._page_size = (
            num_qo_heads, num_kv_heads, head_dim, page_size
        )
        self._causal, self._window_left, self._logits_soft_cap = causal, window_left, logits_soft_cap or 0.0
        self._sm_scale = sm_scale
        self._q_dtype = q_data_type
        self._kv_dtype = kv_data_type or q_data_type
        self.num_plans += 1

    def _run(self, q, paged_kv_cache, out, lse, return_lse, window_left):
        k_cache, v_cache = _unpack(paged_kv_cache, self._kv_layout)
        assert q.dtype == self._q_dtype and k_cache.dtype == self._kv_dtype, "dtypes differ from plan()"
        assert q.dim() == 3 and q.shape[1:] == (self._num_qo_heads, self._head_dim), q.shape
        assert k_cache.shape[1] == self._page_size
        if window_left is not None:
            assert window_left == self._window_left
        scale = self._sm_scale if self._sm_scale is not None else self._head_dim**-0.5
        qo = self._qo_indptr_buf.tolist()
        indptr = self._paged_kv_indptr_buf.tolist()
        last = self._paged_kv_last_page_len_buf.tolist()
        assert qo[-1] == q.shape[0], f"q has {q.shape[0]} rows, the plan {qo[-1]}"
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        assert out.shape == q.shape
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        group = self._num_qo_heads // self._num_kv_heads
        for i in range(len(last)):
            pages = self._paged_kv_indices_buf[indptr[i] : indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * self._page_size + last[i]
            k = k_cache[pages].reshape(-1, self._num_kv_heads, self._head_dim)[:kv_len].float()
            v = v_cache[pages].reshape(-1, self._num_kv_heads, self._head_dim)[:kv_len].float()
            rows = slice(qo[i], qo[i + 1])
            qi = q[rows].float()
            qo_len = qi.shape[0]
            if qo_len == 0:
                continue
            logits = torch.einsum("qhd,khd->hqk", qi, k.repeat_interleave(group, dim=1)) * scale
            q_pos = torch.arange(kv_len - qo_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            mask = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device)
            if self._causal:
                mask &= k_pos <= q_pos
            if self._window_left >= 0:
                mask &= k_pos >= q_pos - self._window_left
            logits = logits.masked_fill(~mask, float("-inf"))
            row_lse = torch.logsumexp(logits, dim=-1)  # [h, q]
            probs = torch.exp(logits - row_lse[..., None])
            o = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, dim=1))
            out[rows] = o.to(out.dtype)
            if return_lse:
                lse[rows] = row_lse.transpose(0, 1)
        return (out, lse) if return_lse else out


class BatchDecodeWithPagedKVCacheWrapper(_PagedAttention):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
    ) -> None:
        qo_buf = None
        if use_cuda_graph:
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            qo_buf = torch.arange(self._fixed_batch_size + 1, dtype=torch.int32, device=float_workspace_buffer.device)
        self._init(float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buffer,
                   paged_kv_indices_buffer, paged_kv_last_page_len_buffer, qo_buf)
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        data_type=None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
    ) -> None:
        assert pos_encoding_mode == "NONE"
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._store_plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                         page_size, False, window_left, sm_scale, q_data_type, kv_data_type, logits_soft_cap)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1):
        return self._run(q, paged_kv_cache, out, lse, return_lse, window_left)


class BatchPrefillWithPagedKVCacheWrapper(_PagedAttention):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
    ) -> None:
        assert backend in ("auto", "fa2", "fa3", "cudnn", "trtllm-gen"), backend
        self.backend = backend
        if use_cuda_graph:
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        self._init(float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buf, paged_kv_indices_buf,
                   paged_kv_last_page_len_buf, qo_indptr_buf)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask=None,
        packed_custom_mask=None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
    ) -> None:
        assert pos_encoding_mode == "NONE" and custom_mask is None and packed_custom_mask is None
        _check_int32(qo_indptr=qo_indptr)
        self._store_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim_qk, page_size, causal, window_left, sm_scale, q_data_type,
                         kv_data_type, logits_soft_cap)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        return self._run(q, paged_kv_cache, out, lse, return_lse, window_left)


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask=None) -> None:
    assert mask is None
    assert s.dtype == torch.float32 and s.shape == v.shape[:2] and v.shape == v_other.shape
    m = torch.maximum(s, s_other.float())
    w, w_other = torch.exp(s - m), torch.exp(s_other.float() - m)
    total = w + w_other
    merged = (v.float() * w[..., None] + v_other.float() * w_other[..., None]) / total[..., None]
    v.copy_(merged.to(v.dtype))
    s.copy_(m + torch.log(total))

