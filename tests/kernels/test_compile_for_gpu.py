"""Every Triton kernel compiles for a Hopper GPU (sm_90) on a machine without one.

The interpreter (what runs the kernels' tests on the CPU) executes the kernels as Python and accepts code
the GPU compiler refuses; here Triton's own compiler lowers each kernel to PTX for ``cuda:90`` in every mode
the host side launches it in (bias kinds, masks, split or single decode, the skip, backward kernels,
half and float32 tables for RoPE). Runs in a subprocess: this folder's tests turn the interpreter on,
under which ``triton.jit`` makes no compilable kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from torchembed.kernels import alibi_triton as B, attention_triton as A, rope_triton as R

    HALF = {"Q", "K", "V", "Out", "DO", "DK", "DV", "DQ", "q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "out_ptr"}
    F32 = {"Lse", "Part", "Bias", "Delta", "KNorm", "Reach", "Horizon", "kb_ptr", "cos_ptr", "sin_ptr", "inv_freq_ptr"}
    OTHER = {"Rows": "*i32", "Keep": "*u8", "keep_ptr": "*u8", "pos_ptr": "*i64"}
    FLOATS = {"qk_scale", "scale", "skip_log2", "MIN"}

    def kind(fn, name, half):
        if fn is B.prefill_bias_kernel and name in ("Q", "K"):
            return "i32"
        if name in HALF:
            return "*" + half
        return "*fp32" if name in F32 else OTHER.get(name, "fp32" if name in FLOATS else "i32")

    def compile_(fn, half="bf16", **constexprs):
        sig = {p.name: "constexpr" if p.is_constexpr else kind(fn, p.name, half) for p in fn.params}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

    for bias, mask in itertools.product((0, 1, 2), (0, 1)):
        compile_(A._decode_kernel, HEAD_DIM=128, BLOCK_R=16, BLOCK_N=64, BLOCK_D=128, BIAS=bias, MASK=mask, PREC=0,
                 SINGLE=False, STORE_LSE=False)
        compile_(A._fwd_kernel, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, BIAS=bias, MASK=mask, PREC=0,
                 STORE_LSE=True, TMA=False, SKIP=bias < 2)
    compile_(A._decode_kernel, HEAD_DIM=96, BLOCK_R=32, BLOCK_N=32, BLOCK_D=128, BIAS=0, MASK=1, PREC=0, SINGLE=True,
             STORE_LSE=True)
    compile_(A._fwd_kernel, "fp32", HEAD_DIM=64, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64, BIAS=0, MASK=0, PREC=1,
             STORE_LSE=False, TMA=False, SKIP=False)
    compile_(A._combine_kernel, HEAD_DIM=128, BLOCK_R=16, BLOCK_D=128, BLOCK_C=32, BLOCK_S=64, STORE_LSE=True, PREC=0)
    for bias in (0, 1):
        compile_(A._bwd_delta_kernel, HEAD_DIM=64, BLOCK_M=64, BLOCK_D=64, BIAS=bias, MASK=1, SKIP=True)
        compile_(A._bwd_dkdv_kernel, HEAD_DIM=64, BLOCK_M=32, BLOCK_N=64, BLOCK_D=64, BIAS=bias, MASK=1, PREC=0,
                 SKIP=True, HBLOCK=64)
        compile_(A._bwd_dq_kernel, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64, BIAS=bias, MASK=1, PREC=0,
                 SKIP=True)
    compile_(A._rows_kernel, BLOCK_Q=16, BLOCK_K=512)
    compile_(A._key_norm_kernel, HEAD_DIM=128, BLOCK_K=64, BLOCK_D=128, PARTS=A.NORM_PARTS)
    compile_(B.prefill_bias_kernel, BLOCK_Q=16, BLOCK_K=256, EMULATE_RTNE=False)
    for half, pos_mode, halves in (("bf16", 0, 1), ("fp16", 1, 0), ("bf16", 2, 0)):
        compile_(R.rope_kernel, half, HALF=64, D=128, BLOCK_D=64, BLOCK_P=1, BLOCK_S=4, HPP=4, POS_MODE=pos_mode,
                 USE_INV_FREQ=pos_mode == 1, INTERLEAVED=False, CONJUGATE=False, HALVES=halves, HAS_PASS=False,
                 CDT=R.COMPUTE_DTYPES["fp32"], EMULATE_RTNE=False, HEADS_FAST=True)
    print("compiled")
''')


def _compile(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)


def _has_nvidia_backend() -> bool:
    probe = "from triton.backends.nvidia.compiler import CUDABackend; print('yes')"
    return _compile(probe).stdout.strip() == "yes"


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    if not _has_nvidia_backend():
        pytest.skip("the installed Triton has no NVIDIA backend")
    done = _compile(SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
