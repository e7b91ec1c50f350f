"""The triton backend's kernels and the decode-path GEMV compile for a Hopper GPU (sm_90),
with programmatic dependent launch, on a machine without one.

The interpreter runs kernels as Python and accepts things the compiler rejects (types that
change across loop iterations, shared memory overflow...). Triton's wheel bundles ptxas, so
the whole compiler pipeline down to a cubin runs on the CPU. It runs in a subprocess: the
kernels must be decorated for the compiler, not for the interpreter other tests use.
"""

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagelm.backends.triton import kv_store, paged_attention as pa
    from pagelm.backends.kernels import gemv as triton_gemv

    TARGET = GPUTarget("cuda", 90, 32)
    TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}

    def compile_kernel(kernel, types, constexprs):
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
        options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in constexprs}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)
        assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared  # H100 shared memory per block
        return compiled

    cache = torch.empty(1, 16, 1, 1)  # only its block size is read
    for dtype, group, head_dim, max_query_len, split, fuse_reduce in [
        (torch.bfloat16, 4, 128, 1, True, True),     # split-K decode merged in-kernel, Llama-3-8B heads
        (torch.bfloat16, 2, 128, 1, True, True),     # the same, Qwen3-0.6B heads
        (torch.bfloat16, 4, 128, 1, True, False),    # split-K decode + reduce launch
        (torch.bfloat16, 2, 128, 4, True, True),     # split-K verification of 3 drafts, Qwen3 heads
        (torch.float32, 3, 64, 1, True, True),       # in-kernel merge, group not a power of two
        (torch.bfloat16, 4, 128, 512, False, False), # prefill
        (torch.bfloat16, 1, 64, 512, False, False),  # MHA prefill, head 64
        (torch.float16, 8, 128, 1, False, False),    # decode without splits
        (torch.float32, 2, 64, 512, False, False),   # exact float32 dot
        (torch.bfloat16, 2, 256, 512, False, False), # largest head size
    ]:
        cfg = pa.tile_config(group, head_dim, max_query_len)
        block_q = 1 if split else cfg.block_m // group
        constexprs = pa._constexprs(group, head_dim, cache, cfg, block_q, dtype, None)
        constexprs.update(SPLIT=split, SPLIT_Q=max_query_len if split else 1,
                          FUSE_REDUCE=fuse_reduce, SPLITS_PAD=32, USE_PDL=True, launch_pdl=True)
        io = dict.fromkeys(["out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"], TYPES[dtype])
        io.update(dict.fromkeys(["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"], "*i32"))
        io.update(decode_req_idx_ptr="*i32", split_counter_ptr="*i32")
        io.update(dict.fromkeys(["partial_m_ptr", "partial_l_ptr", "partial_acc_ptr"], "*fp32"), scale_log2="fp32")
        compiled = compile_kernel(pa._paged_attention_kernel, io, constexprs)
        if fuse_reduce:
            # The merge's release/acquire: a CTA barrier, then one acq_rel atomic at GPU scope.
            ptx = compiled.asm["ptx"]
            assert "bar.sync" in ptx and "atom.global.gpu.acq_rel.add" in ptx, ptx[-3000:]

    compile_kernel(
        pa._reduce_splits_kernel,
        {"out_ptr": "*bf16", "partial_m_ptr": "*fp32", "partial_l_ptr": "*fp32", "partial_acc_ptr": "*fp32",
         "decode_req_idx_ptr": "*i32", "query_start_loc_ptr": "*i32"},
        dict(HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=32, SPLIT_Q=4, USE_PDL=True, launch_pdl=True),
    )
    compile_kernel(
        kv_store._store_kv_kernel,
        dict.fromkeys(["key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"], "*bf16")
        | {"slot_mapping_ptr": "*i64", "stride_cache_block": "i64"},
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, KV_HEADS_PAD=8, HEAD_PAD=128, BLOCK_SIZE=16, USE_PDL=True, launch_pdl=True),
    )
    for dtype, heads, kv_heads, head_dim, rotary_dim, norm in [
        (torch.bfloat16, 16, 8, 128, 128, True),   # Qwen3-0.6B: q/k norm + rotary + store
        (torch.bfloat16, 32, 8, 128, 128, False),  # Llama-3-8B: rotary + store
        (torch.float16, 8, 2, 64, 32, False),      # partial rotary: the rest of k copied
    ]:
        half_pad = rotary_dim // 2
        compile_kernel(
            kv_store._rotary_store_kv_kernel,
            dict.fromkeys(["query_ptr", "key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr",
                           "q_norm_w_ptr", "k_norm_w_ptr"], TYPES[dtype])
            | {"slot_mapping_ptr": "*i64", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "eps": "fp32",
               "stride_cache_block": "i64"},
            dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=rotary_dim // 2, HALF_PAD=half_pad,
                 TAIL_PAD=triton.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0,
                 HEAD_PAD=head_dim, Q_BLOCK_H=min(heads, 2048 // half_pad), KV_HEADS_PAD=kv_heads, BLOCK_SIZE=16,
                 INTERPRETED=False, NORM=norm, USE_PDL=True, num_warps=4, launch_pdl=True),
        )
    for silu, norm, residual, even_k in [(False, False, False, True), (True, False, False, True),
                                         (False, True, True, True), (False, True, False, False)]:
        compile_kernel(
            triton_gemv._gemv_kernel,
            dict.fromkeys(["y_ptr", "x_ptr", "w_ptr", "b_ptr", "residual_ptr", "residual_out_ptr", "norm_weight_ptr"], "*bf16")
            | {"eps": "fp32"},
            dict(HAS_BIAS=False, SILU_INPUT=silu, NORM=norm, HAS_RESIDUAL=residual, PREFETCH=False, ALL_REDUCE=False,
                 BLOCK_N=4, BLOCK_K=1024, EVEN_K=even_k, USE_PDL=True, INTERPRETED=False,
                 num_warps=4, launch_pdl=True),
        )
    for silu in (False, True):  # the two-rank all-reduce's exchange
        compile_kernel(
            triton_gemv._gemv_kernel,
            dict.fromkeys(["y_ptr", "x_ptr", "w_ptr", "b_ptr", "residual_ptr", "residual_out_ptr", "norm_weight_ptr",
                           "send_ptr", "recv_ptr"], "*bf16")
            | {"eps": "fp32"},
            dict(HAS_BIAS=False, SILU_INPUT=silu, NORM=False, HAS_RESIDUAL=False, PREFETCH=False, ALL_REDUCE=True,
                 BLOCK_N=8, BLOCK_K=1024, EVEN_K=True, USE_PDL=True, INTERPRETED=False, num_warps=4,
                 launch_pdl=True),
        )
    print("compiled")
    """
)


@pytest.mark.skipif(
    tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 3),
    reason="ASTSource takes constexprs in the signature from Triton 3.3 on",
)
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("compiled")
