"""``rotary_fused``: the one entry into the fused RoPE kernel (host side), Su et al., "RoFormer", arXiv:2104.09864.

Validation, the launch configuration and cache, the PyTorch fallback, the custom ops and the autograd; every caller
(``RotaryEmbedding``, the patched HF attention, the backward) goes through :func:`rotary_fused`. Device code:
:mod:`torchembed.kernels.rope_triton`, imported on the first launch.

Positions, one meaning per form (``B`` batch, ``S`` tokens, ``R`` rotated features):

=====================  ========================================  ===========================
``positions``          position of token ``s`` of sequence ``b``  angles from
=====================  ========================================  ===========================
None                   (given by the tables' rows)                per-token ``cos``/``sin``
                                                                  ``(B or 1, S, R/2)``
int ``o``              ``o + s``                                  cache ``(T, R/2)`` or inv_freq
``(B,)`` tensor        ``positions[b] + s`` (per-sequence offsets) cache or inv_freq
``(B or 1, S)`` tensor ``positions[b, s]`` (position ids)         cache or inv_freq
=====================  ========================================  ===========================

A call is keyed by what its tensors are, never their values (:func:`_key`). The first call of a key is validated and
launched through Triton and the launch kept (:data:`LAUNCHES`): a later call of the key repeats it with its own
pointers, offset and scale, without validation or Triton's per-call binding (a decode step costs little more than the
launch itself).

Routes: eager without gradients -> :func:`_rotate`; eager with autograd -> :class:`_Rotary`; ``torch.compile`` -> the
custom ops ``torchembed::rotary`` (out of place, same autograd) and ``torchembed::rotary_`` (in place, no autograd),
whose arguments are :class:`RopeArgs` in order. Where the kernel cannot run, the same float32 math runs in PyTorch
(:func:`torchembed.functional.apply_rotary`); whether a caller takes the kernel is
:func:`torchembed.kernels.route.use_rope_kernel`'s answer.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from torchembed import functional
from torchembed.kernels import launch
from torchembed.kernels.launch import kernel_can_run, triton_disabled
from torchembed.kernels.settings import settings

__all__ = ["LAUNCHES", "RopeArgs", "clear_launches", "rotary_fused", "rotary_fused_usual"]


class RopeArgs(NamedTuple):
    """The arguments of one rotation, validated (the custom ops' schema, in order): :func:`rotary_fused`'s, with
    ``positions`` a tensor (the module docstring's forms) or None and ``offset`` the int offset (0 for tensor positions
    and per-token tables); ``halves`` 1 for full-width tables (``rotary_fused(halves=True)``), 2 the same with the two
    halves' sines exchanged (the backward of 1), else 0 (rows of ``R/2`` entries)."""

    q: Tensor
    k: Tensor
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    inv_freq: Optional[Tensor]
    positions: Optional[Tensor]
    offset: int
    scale: float
    interleaved: bool
    conjugate: bool
    halves: int = 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _config(a: RopeArgs, inplace: bool) -> tuple[tuple[int, int, int], dict, int, int]:
    """(grid, meta-parameters, number of q head groups, warps) of the launch for ``a``."""
    t = settings().rope
    B, Hq, S, D = a.q.shape
    Hk = a.k.shape[1]
    half = (a.inv_freq if a.cos is None else a.cos).shape[-1] // (2 if a.halves else 1)
    block_d = _next_pow2(half)
    block_s = min(_next_pow2(S), max(1, t.tile_pairs // block_d))
    n_s = -(-S // block_s)
    hpp = 1
    if n_s * B * (Hq + Hk) >= t.grouped_min_programs:
        hpp = next((c for c in t.grouped_heads if Hq % c == 0 and Hk % c == 0), 1)
    has_pass = not inplace and 2 * half < D
    lanes = block_s * block_d
    heads_fast = t.heads_fast and n_s < 65536  # grid axis 1 holds at most 65535
    meta = dict(
        HALF=half, D=D, BLOCK_D=block_d, BLOCK_P=_next_pow2(D - 2 * half) if has_pass else 1, BLOCK_S=block_s,
        HPP=hpp, POS_MODE=0 if a.positions is None else a.positions.dim(), USE_INV_FREQ=a.cos is None,
        INTERLEAVED=a.interleaved, CONJUGATE=a.conjugate, HALVES=a.halves, HAS_PASS=has_pass,
        CDT="fp64" if a.q.dtype == torch.float64 else "fp32",
        # The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even.
        EMULATE_RTNE=not a.q.is_cuda and a.q.dtype == torch.bfloat16, HEADS_FAST=heads_fast,
    )
    warps = t.grouped_warps if hpp > 1 else 1 if lanes <= 128 else 2 if lanes <= 512 else 4
    n_h = Hq // hpp + Hk // hpp
    return ((n_h, n_s, B) if heads_fast else (n_s, n_h, B)), meta, Hq // hpp, warps


# --- The launch cache -------------------------------------------------------------------------

# key -> the kept Launch; its tensors (see _tensors) and scalars (offset, scale) are given per call
LAUNCHES = launch.Launches(4096)
_I32 = 2**31


def clear_launches() -> None:
    """Forget every kept launch."""
    LAUNCHES.clear()


def _tensor_key(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _key(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate, halves) -> Optional[tuple]:
    """The launch-cache key of a call with these arguments (``positions`` as given to :func:`rotary_fused`), built
    here only: shapes, strides, dtypes, devices, position form and flags, never values; an int offset enters as the
    facts Triton specialises on. None for the calls below, never kept (tensor positions indexing a CPU table, say, are
    range-checked on every call)."""
    if (type(q) is not Tensor or type(k) is not Tensor or q.dim() != 4 or type(interleaved) is not bool
            or type(inplace) is not bool or type(conjugate) is not bool or type(scale) not in (float, int)):
        return None
    if positions is None:
        pos = None
    elif type(positions) is int:
        if positions < 0 or (type(cos) is Tensor and positions + q.shape[2] > cos.shape[0]):
            return None
        pos = (positions == 1, positions % 16 == 0, positions < _I32)
    elif type(positions) is Tensor:
        if cos is not None and not q.is_cuda:
            return None
        pos = _tensor_key(positions)
    else:
        return None
    if inv_freq is not None:
        if cos is not None or sin is not None or type(inv_freq) is not Tensor:
            return None
        angles = _tensor_key(inv_freq)
    elif type(cos) is Tensor and type(sin) is Tensor:
        angles = (cos.shape, cos.stride(), cos.dtype, cos.device, sin.shape, sin.stride(), sin.dtype, sin.device)
    else:
        return None
    return (q.shape, k.shape, q.stride(), k.stride(), q.dtype, k.dtype, q.device, k.device, angles, pos,
            interleaved, inplace, conjugate, halves)


def _setup(a: RopeArgs, qo: Tensor, ko: Tensor) -> launch.Launch:
    """The launch that rotates ``a`` into ``qo``/``ko`` (which may be ``a.q``/``a.k``)."""
    from torchembed.kernels import rope_triton  # (and Triton: on the first launch only)

    q, k, cos, positions = a.q, a.k, a.cos, a.positions
    grid, meta, nqg, warps = _config(a, qo is q)
    meta["CDT"] = rope_triton.COMPUTE_DTYPES[meta["CDT"]]  # float32 math (float64 for float64 inputs)
    if cos is None:
        sc_b = sc_s = 0
    elif cos.dim() == 3:  # per-token (Bc, S, R/2), Bc in {1, B}
        sc_b, sc_s = (cos.stride(0) if cos.shape[0] != 1 else 0), cos.stride(1)
    else:  # cache (T, R/2), indexed by positions or by offset + s
        sc_b, sc_s = 0, cos.stride(0)
    if positions is None:
        sp_b = sp_s = 0
    else:
        sp_b = positions.stride(0) if positions.shape[0] != 1 else 0
        sp_s = positions.stride(1) if positions.dim() == 2 else 0
    sq, sk, sqo, sko = q.stride(), k.stride(), qo.stride(), ko.stride()
    fixed = (q.shape[2], nqg, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
             sc_b, sc_s, sp_b, sp_s)
    return launch.Launch(rope_triton.rope_kernel, grid, fixed, meta, num_warps=warps)


def _tensors(q, k, qo, ko, cos, sin, inv_freq, positions) -> tuple:
    """The kernel's tensor arguments (q, k, q_out, k_out, cos, sin, positions, inv_freq); ``q`` stands in for the
    absent ones (never read)."""
    pos = q if positions is None else positions
    if cos is None:
        return q, k, qo, ko, inv_freq, inv_freq, pos, inv_freq
    return q, k, qo, ko, cos, sin, pos, q


# --- Validation (attribute reads and int compares; no tensor ops, no host syncs on accelerators) ---

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(f"rotary_fused: {msg}")


def _validate(q, k, cos, sin, inv_freq, positions, scale, interleaved, conjugate, halves=0) -> RopeArgs | str:
    """The arguments of ``rotary_fused`` as the kernel takes them, or why it does not take them. Tensor positions
    indexing cos/sin cache tables are range-checked on the host for CPU tensors only (on accelerators: a host sync)."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        return f"expected q and k to be tensors, got {type(q).__name__} and {type(k).__name__}"
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4:
        return f"expected 4-D q and k (B, H, S, D), got q {tuple(qs)} and k {tuple(ks)}"
    if q.dtype not in _KERNEL_DTYPES or k.dtype != q.dtype:
        return f"expected q and k of one floating dtype in {_KERNEL_DTYPES}, got {q.dtype} and {k.dtype}"
    dev = q.device
    if k.device != dev:
        return f"expected k on q's device {dev}, got {k.device}"
    B, _, S, D = qs
    if ks[0] != B or ks[2] != S or ks[3] != D:
        return f"expected q and k with the same B, S, D, got q {tuple(qs)} and k {tuple(ks)}"

    pos_t, offset = None, 0
    if isinstance(positions, Tensor):
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            return f"expected integer positions, got dtype {positions.dtype}"
        if positions.device != dev:
            return f"expected positions on q's device {dev}, got {positions.device}"
        ps = positions.shape
        if not (ps[:1] in ((1,), (B,)) and (len(ps) == 1 or (len(ps) == 2 and ps[1] == S))):
            return (f"expected positions of shape ({B},) (per-sequence offsets) or ({B} or 1, {S}) (position ids), "
                  f"got {tuple(ps)}")
        pos_t = positions
    elif isinstance(positions, int) and not isinstance(positions, bool):
        if positions < 0:
            return f"expected a non-negative int offset, got {positions}"
        offset = positions
    elif positions is not None:
        return f"expected positions None, an int offset or an integer tensor, got {type(positions).__name__}"

    if (cos is not None or sin is not None) == (inv_freq is not None):
        return ("expected either cos and sin tables or inv_freq=, got " + ("both" if inv_freq is not None else "neither"))
    if inv_freq is None:
        if not isinstance(cos, Tensor) or not isinstance(sin, Tensor):
            return f"expected cos and sin tensors together, got cos={type(cos).__name__} sin={type(sin).__name__}"
        if not cos.is_floating_point() or not sin.is_floating_point():
            return f"expected floating cos/sin, got {cos.dtype} and {sin.dtype}"
        if cos.device != dev or sin.device != dev:
            return f"expected cos/sin on q's device {dev}, got {cos.device} and {sin.device}"
        if cos.shape != sin.shape:
            return f"expected cos and sin of the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        cs = cos.shape
        half = (cs[-1] if cs else 0) // (2 if halves else 1)
        if halves and (halves not in (1, 2) or interleaved or cs[-1] % 2):
            return (f"expected with halves full-width cos/sin rows (an even number R of entries) and half-split "
                  f"pairing, got rows of {cs[-1] if cs else 0} entries, halves={halves!r}, interleaved={interleaved}")
        if positions is None:
            if len(cs) != 3 or cs[0] not in (1, B) or cs[1] != S:
                return f"expected per-token cos/sin of shape ({B} or 1, {S}, R/2) when positions is None, got {tuple(cs)}"
        elif len(cs) != 2:
            return f"expected cos/sin cache tables of shape (T, R/2) when positions is given, got {tuple(cs)}"
        elif pos_t is None and offset + S > cs[0]:
            return f"expected offset + S <= table length, got {offset} + {S} > {cs[0]}"
        elif pos_t is not None and dev.type == "cpu" and pos_t.numel() and S and not torch.compiler.is_compiling():
            # An index past either end of the table would wrap or fail deep in the fallback, or read out of
            # bounds in the interpreted kernel.
            low, high = int(pos_t.min()), int(pos_t.max()) + (S - 1 if pos_t.dim() == 1 else 0)
            if low < 0 or high >= cs[0]:
                return f"expected tensor positions in [0, table length {cs[0]}), got positions {low}..{high}"
        # The kernel needs a unit last stride and one stride for both tables (small: copied here; q and k never are).
        st = cos.stride()
        if st != sin.stride() or (st and st[-1] != 1):
            cos, sin = cos.contiguous(), sin.contiguous()
    else:
        if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or not inv_freq.is_floating_point():
            return f"expected inv_freq a 1-D floating tensor (R/2,), got {getattr(inv_freq, 'shape', inv_freq)}"
        if inv_freq.device != dev:
            return f"expected inv_freq on q's device {dev}, got {inv_freq.device}"
        if positions is None:
            return "expected positions (int, (B,) or (B, S) tensor) with inv_freq=, got None"
        half = inv_freq.shape[0]
        if inv_freq.stride(0) != 1:
            inv_freq = inv_freq.contiguous()
    if half < 1:
        return f"expected a positive even rotary dim R = 2 * cos.shape[-1], got R = {2 * half}"
    if 2 * half > D:
        hint = ""
        if cos is not None and 2 * D >= 2 * half:  # HF's (and Liger's) full-width tables
            first = "[..., ::2]" if interleaved else f"[..., :{half // 2}]"
            hint = (f"; cos/sin with {half} entries per row look like HF's full tables "
                    f"({'repeat_interleave' if interleaved else 'cat'}(freqs, freqs)): rotary_fused takes half "
                    f"tables (R/2 entries), e.g. cos{first}, sin{first}")
        return f"expected rotary dim R = 2 * {half} = {2 * half} <= head dim D = {D}{hint}"
    if isinstance(scale, (Tensor, bool)) or not isinstance(scale, (int, float)):
        return f"expected a Python number scale, got {type(scale).__name__}"
    if not isinstance(interleaved, bool) or not isinstance(conjugate, bool):
        return f"expected bool interleaved and conjugate, got {interleaved!r} and {conjugate!r}"
    if halves and inv_freq is not None:
        return "expected cos/sin tables with halves, got inv_freq"
    return RopeArgs(q, k, cos, sin, inv_freq, pos_t, offset, float(scale), interleaved, conjugate, int(halves))


# --- The rotation: the kernel where it runs, the PyTorch reference elsewhere -------------------

_empty_like = torch.empty_like  # module-level so tests can poison fresh outputs


def _alloc_like(x: Tensor) -> Tensor:
    """Output buffer: ``empty_like`` keeps a dense input's strides (HF's (B, H, S, D) view over (B, S, H, D) memory
    gets an output in its memory order); otherwise contiguous. The fake impl's rule too, so compiled and eager agree."""
    if x.stride(-1) == 1:
        return _empty_like(x)
    return _empty_like(x, memory_format=torch.contiguous_format)


def _reference_tables(a: RopeArgs) -> Tuple[Tensor, Tensor]:
    """``(Bc, 1, S, W)`` cos/sin with the kernel's semantics, for the PyTorch path (``W``: ``R`` with ``halves``,
    else ``R/2``)."""
    if a.inv_freq is None and a.cos.dim() == 3:
        c, s = a.cos, a.sin
    else:
        ar = torch.arange(a.q.shape[2], device=a.q.device)
        pos = (ar + a.offset)[None] if a.positions is None else a.positions.long()
        if pos.dim() == 1:
            pos = pos[:, None] + ar
        if a.inv_freq is None:
            c, s = a.cos[pos], a.sin[pos]
        elif a.q.dtype == torch.float64:  # the kernel's float32 angle, its cos and sin in float64
            angle = (pos.float()[..., None] * a.inv_freq.float()).double()
            c, s = angle.cos(), angle.sin()
        else:  # the float32 angle and tables, as the kernel computes them
            c, s = functional.rope_cos_sin(a.inv_freq.float(), pos)
    if a.scale != 1.0:
        c, s = c.float() * a.scale, s.float() * a.scale
    if a.halves == 2:  # the transpose of halves == 1: the two halves' sines exchanged
        h = s.shape[-1] // 2
        s = torch.cat((s[..., h:], s[..., :h]), dim=-1)
    return c[:, None], s[:, None]


def _run(a: RopeArgs, qo: Tensor, ko: Tensor) -> None:
    """Rotate ``a.q``/``a.k`` into ``qo``/``ko`` (which may be they); all have a unit last stride.
    Where the kernel cannot run: :func:`torchembed.functional.apply_rotary`, the same float32 math."""
    q, k = a.q, a.k
    if kernel_can_run(q):  # (the custom ops' body defends itself: rotary_fused is public, the reference runs elsewhere)
        # positions as the caller gave them: a tensor, None for per-token tables, else the int offset
        given = a.positions if a.positions is not None else None if a.cos is not None and a.cos.dim() == 3 else a.offset
        key = _key(q, k, a.cos, a.sin, a.inv_freq, given, a.scale, a.interleaved, qo is q, a.conjugate, a.halves)
        kept = None if key is None else LAUNCHES.get(key)
        if kept is None:
            kept = _setup(a, qo, ko)
            if key is not None:
                LAUNCHES.keep(key, kept)
        kept(_tensors(q, k, qo, ko, a.cos, a.sin, a.inv_freq, a.positions), a.offset, a.scale)
        return
    c, s = _reference_tables(a)
    for x, out in ((q, qo), (k, ko)):
        out.copy_(functional.apply_rotary(x, c, s, interleaved=a.interleaved, conjugate=a.conjugate, full=bool(a.halves)))


def _rotate(a: RopeArgs) -> Tuple[Tensor, Tensor]:
    """Out of place. A q or k whose last dim is not unit-stride (HF never makes one) is copied first;
    its output is then contiguous, as :func:`_alloc_like` (the fake impl's rule) says."""
    if a.q.stride(-1) != 1 or a.k.stride(-1) != 1:
        a = a._replace(q=a.q if a.q.stride(-1) == 1 else a.q.contiguous(),
                       k=a.k if a.k.stride(-1) == 1 else a.k.contiguous())
    qo, ko = _empty_like(a.q), _empty_like(a.k)
    _run(a, qo, ko)
    return qo, ko


def _rotate_(a: RopeArgs) -> None:
    """In place (a non-unit last-dim stride: out of place, then copied back)."""
    if a.q.stride(-1) != 1 or a.k.stride(-1) != 1:
        qo, ko = _rotate(a)
        a.q.copy_(qo)
        a.k.copy_(ko)
    else:
        _run(a, a.q, a.k)


# --- Custom ops (what torch.compile sees) and the one autograd definition ----------------------


@torch.library.custom_op("torchembed::rotary", mutates_args=())
def _rotary_op(q: Tensor, k: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], inv_freq: Optional[Tensor],
               positions: Optional[Tensor], pos_offset: int, scale: float, interleaved: bool,
               conjugate: bool, halves: int = 0) -> Tuple[Tensor, Tensor]:
    return _rotate(RopeArgs(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate, halves))


@_rotary_op.register_fake
def _rotary_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate, halves=0):
    return _alloc_like(q), _alloc_like(k)


@torch.library.custom_op("torchembed::rotary_", mutates_args=("q", "k"))
def _rotary_inplace_op(q: Tensor, k: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], inv_freq: Optional[Tensor],
                       positions: Optional[Tensor], pos_offset: int, scale: float, interleaved: bool,
                       conjugate: bool, halves: int = 0) -> None:
    _rotate_(RopeArgs(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate, halves))


@_rotary_inplace_op.register_fake
def _rotary_inplace_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate, halves=0):
    return None


class _Rotary(torch.autograd.Function):
    """The autograd of the out-of-place rotation, once: eager calls apply this Function (no custom-op dispatch,
    whose Python cost is several times a decode-sized kernel); ``torchembed::rotary`` registers the same
    ``setup_context`` and ``backward`` for torch.compile.

    The rotation is orthogonal (times ``scale``): the gradient of q/k is the conjugate rotation of the incoming
    gradient; cos/sin/inv_freq/positions get none (constants). Differentiable under ``create_graph=True``.
    """

    @staticmethod
    def forward(*args):
        return _rotate(RopeArgs(*args))

    @staticmethod
    def setup_context(ctx, inputs, output):
        a = RopeArgs(*inputs)
        ctx.save_for_backward(a.cos, a.sin, a.inv_freq, a.positions)
        ctx.consts = (a.offset, a.scale, a.interleaved, a.conjugate, a.halves)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, inv_freq, positions = ctx.saved_tensors
        offset, scale, interleaved, conjugate, halves = ctx.consts
        # the transpose: the inverse rotation; with halves, the two halves' sines exchanged as well
        a = RopeArgs(grad_q, grad_k, cos, sin, inv_freq, positions, offset, scale, interleaved, not conjugate,
                     (0, 2, 1)[halves])
        if type(grad_q) is not Tensor or type(grad_k) is not Tensor or torch.compiler.is_compiling():
            dq, dk = torch.ops.torchembed.rotary(*a)  # traced (compile) or a tensor subclass: the op
        elif torch.is_grad_enabled():  # create_graph=True: stay differentiable
            dq, dk = _Rotary.apply(*a)
        else:
            dq, dk = _rotate(a)
        return dq, dk, None, None, None, None, None, None, None, None, None


_rotary_op.register_autograd(_Rotary.backward, setup_context=_Rotary.setup_context)


# --- The entry points ---------------------------------------------------------------------------


def _kept_launch(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate,
                 halves) -> Optional[Tuple[Tensor, Tensor]]:
    """A call like one launched before (outside autograd and compile): that launch again, at once, without
    validation; None where no launch is kept for it."""
    key = _key(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate, halves)
    kept = None if key is None else LAUNCHES.get(key)
    if kept is None or triton_disabled():  # (a launch kept before TORCHEMBED_DISABLE_TRITON=1 was set is not used)
        return None
    qo, ko = (q, k) if inplace else (_empty_like(q), _empty_like(k))
    pos, offset = (None, positions) if type(positions) is int else (positions, 0)
    kept(_tensors(q, k, qo, ko, cos, sin, inv_freq, pos), offset, scale)
    return qo, ko


def rotary_fused_usual(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """HF's usual call on the kernel, ``rotary_fused(q, k, cos, sin, halves=True)``, in place at inference (out of
    place where autograd records or ``torch.compile`` traces); None where the kernel does not take the call (the
    caller then rotates its own way). The kept launch first; nothing is launched before the call is known to fit."""
    compiling = torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    inplace = not (compiling or recorded)
    if inplace:
        out = _kept_launch(q, k, cos, sin, None, None, 1.0, False, True, False, True)
        if out is not None:
            return out
    a = _validate(q, k, cos, sin, None, None, 1.0, False, False, 1)
    return None if isinstance(a, str) else _call(a, inplace, compiling, recorded)


def rotary_fused(q: Tensor, k: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, *,
                 inv_freq: Optional[Tensor] = None, scale: float = 1.0, positions: Union[None, int, Tensor] = None,
                 interleaved: bool = False, inplace: bool = False, conjugate: bool = False,
                 halves: bool = False) -> Tuple[Tensor, Tensor]:
    """Rotate q and k by their positions' angles with one fused kernel launch.

    Args:
        q: ``(B, Hq, S, D)``, any strides with a unit last stride (HF's transposed ``(B, S, H, D)``
            memory works without a copy; another last stride costs one copy).
        k: ``(B, Hk, S, D)``, q's dtype, device, B, S and D; ``Hk`` may differ (GQA).
        cos, sin: tables of ``R/2`` entries per row (``R`` with ``halves``; ``R <= D`` rotated features;
            ``[R, D)`` pass through): per-token ``(B or 1, S, R/2)`` with ``positions=None``, else a cache ``(T, R/2)``
            indexed by position.
        inv_freq: ``(R/2,)`` instead of tables (needs positions): angle = position * inv_freq in float32.
        scale: multiplies cos and sin (e.g. HF's ``attention_scaling``).
        positions: None, an int offset, ``(B,)`` per-sequence offsets or ``(B or 1, S)`` position ids
            (the module docstring's table). Tensor positions are not range-checked on accelerators.
        interleaved: GPT-J pairing ``(2j, 2j + 1)`` instead of ``(j, j + R/2)``.
        inplace: write into q and k and return them; else new tensors (``empty_like`` layout).
        conjugate: rotate by ``-theta`` (the inverse rotation).
        halves: cos/sin rows hold ``R`` entries (HF's ``cat`` tables): the first ``R/2`` for each pair's first feature,
            the last ``R/2`` for its second; HF's arithmetic with its full tables, also where the two halves differ
            (half-split pairing only).

    Returns:
        ``(q_rot, k_rot)``, the input shapes and dtype; float32 math (float64 for float64 inputs),
        rounded once. Gradients flow to q and k (none to the tables or positions).

    Raises:
        ValueError: a shape, dtype, device or position that does not fit, naming expected and given.
    """
    compiling = torch.compiler.is_compiling()
    recorded = torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False))
    if not compiling and not recorded:  # a call like one launched before: that launch again, at once
        out = _kept_launch(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate, halves)
        if out is not None:
            return out
    a = _validate(q, k, cos, sin, inv_freq, positions, scale, interleaved, conjugate, 1 if halves else 0)
    if isinstance(a, str):
        _fail(a)
    if not isinstance(inplace, bool):
        _fail(f"expected a bool inplace, got {inplace!r}")
    return _call(a, inplace, compiling, recorded)


def _call(a: RopeArgs, inplace: bool, compiling: bool, recorded: bool) -> Tuple[Tensor, Tensor]:
    """Checked arguments on their route: the eager launch, the custom op under compile, autograd where recorded."""
    if inplace and not recorded:
        if compiling:
            torch.ops.torchembed.rotary_(*a)
        else:
            _rotate_(a)
        return a.q, a.k
    if compiling:
        qo, ko = torch.ops.torchembed.rotary(*a)
    else:
        qo, ko = _Rotary.apply(*a) if recorded else _rotate(a)
    if inplace:  # a mutating op has no autograd formula: out of place, then copy_ (which autograd tracks)
        a.q.copy_(qo)
        a.k.copy_(ko)
        return a.q, a.k
    return qo, ko
