"""``rotary_fused``: the fused RoPE kernel's public entry point, its custom ops and its autograd.

Routes to the kernel, all through one launch cache (:mod:`torchembed.kernels.rope_launches`):

* eager, no gradient: a call whose key (shapes, strides, dtypes, devices, position form, flags)
  was validated and launched before replays that launch with its own pointers, offset and scale,
  so a decode step costs little more than the launch itself; otherwise it is validated, launched
  and kept;
* eager with autograd: :class:`_Rotary` (an ``autograd.Function``: no custom-op dispatch);
* ``torch.compile``: the custom ops (namespace ``torchembed``), which register the same autograd:
  ``torchembed::rotary(q, k, cos?, sin?, inv_freq?, positions?, pos_offset, scale, interleaved,
  conjugate) -> (Tensor, Tensor)`` (out of place) and ``torchembed::rotary_(...) -> ()`` (mutates
  q and k, no autograd; ``rotary_fused(inplace=True)`` on tensors that need grad goes out of place,
  then ``copy_``).  Their arguments are :class:`RopeArgs` in order.

The positions variants map onto the schema as: ``positions=None`` -> (None, 0); an int offset
-> (None, offset); a ``(B,)`` or ``(B|1, S)`` integer tensor -> (tensor, 0).  ``cos``/``sin``
or ``inv_freq`` is given, the others are None.  3-D cos/sin are per-token tables (positions
None); 2-D cos/sin are position-indexed caches (by the tensor, or by ``pos_offset + s``).

Devices: the Triton kernel runs where ``kernel_can_run`` says so (CUDA, or CPU under
``TRITON_INTERPRET=1``); elsewhere (CPU without the interpreter, meta, Triton missing or
``TORCHEMBED_DISABLE_TRITON=1``) the same float32 math runs in PyTorch, so ``rotary_fused``
works everywhere.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from torchembed.kernels.availability import interpret_mode, kernel_can_run, triton_available
from torchembed.kernels.availability import triton_disabled as _triton_disabled
from torchembed.kernels.rope_launches import LAUNCHES, RopeArgs, key_of

__all__ = ["rotary_fused", "rotary_tables_", "triton_available", "interpret_mode", "kernel_can_run"]


_triton = None


def _kernel_module():
    """``rope_triton`` (which imports Triton), imported on the first launch."""
    global _triton
    from torchembed.kernels import rope_triton

    _triton = rope_triton
    return _triton


# ------------------------------------------------------------------------------------------
# Validation (cheap: attribute reads and Python int compares only; no tensor ops, no syncs)
# ------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(f"rotary_fused: {msg}")


def _validate(q, k, cos, sin, inv_freq, positions, scale, interleaved, conjugate) -> RopeArgs:
    """Check the arguments of ``rotary_fused``; return them as the kernel takes them.

    Tensor positions indexing cos/sin cache tables are range-checked on the host for CPU tensors
    only; on accelerators they are not (no sync)."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        _fail(f"expected q and k to be tensors, got {type(q).__name__} and {type(k).__name__}")
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4:
        _fail(f"expected 4-D q and k (B, H, S, D), got q {tuple(qs)} and k {tuple(ks)}")
    if q.dtype not in _KERNEL_DTYPES or k.dtype != q.dtype:
        _fail(f"expected q and k of one floating dtype in {_KERNEL_DTYPES}, got {q.dtype} and {k.dtype}")
    dev = q.device
    if k.device != dev:
        _fail(f"expected k on q's device {dev}, got {k.device}")
    B, _, S, D = qs
    if ks[0] != B or ks[2] != S or ks[3] != D:
        _fail(f"expected q and k with the same B, S, D, got q {tuple(qs)} and k {tuple(ks)}")

    # -- positions -> (tensor or None, int offset)
    pos_t, pos_off = None, 0
    if positions is None:
        pass
    elif isinstance(positions, Tensor):
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            _fail(f"expected integer positions, got dtype {positions.dtype}")
        if positions.device != dev:
            _fail(f"expected positions on q's device {dev}, got {positions.device}")
        nd = positions.dim()
        if not (
            (nd == 1 and positions.shape[0] in (1, B))
            or (nd == 2 and positions.shape[0] in (1, B) and positions.shape[1] == S)
        ):
            _fail(
                f"expected positions of shape ({B},) (per-batch offsets) or ({B} or 1, {S}) "
                f"(position ids), got {tuple(positions.shape)}"
            )
        pos_t = positions
    elif isinstance(positions, int) and not isinstance(positions, bool):
        if positions < 0:
            _fail(f"expected a non-negative int offset, got {positions}")
        pos_off = positions
    else:
        _fail(f"expected positions None, an int offset or an integer tensor, got {type(positions).__name__}")

    # -- angle source: cos/sin tables xor inv_freq
    has_table = cos is not None or sin is not None
    if has_table and inv_freq is not None:
        _fail("expected either cos/sin or inv_freq, got both")
    if not has_table and inv_freq is None:
        _fail("expected cos and sin tables or inv_freq=, got neither")
    if has_table:
        if not isinstance(cos, Tensor) or not isinstance(sin, Tensor):
            _fail(f"expected cos and sin tensors together, got cos={type(cos).__name__} sin={type(sin).__name__}")
        if not cos.is_floating_point() or not sin.is_floating_point():
            _fail(f"expected floating cos/sin, got {cos.dtype} and {sin.dtype}")
        if cos.device != dev or sin.device != dev:
            _fail(f"expected cos/sin on q's device {dev}, got {cos.device} and {sin.device}")
        if cos.shape != sin.shape:
            _fail(f"expected cos and sin of the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        cs = cos.shape
        half = cs[-1] if cs else 0
        if positions is None:
            if len(cs) != 3 or cs[0] not in (1, B) or cs[1] != S:
                _fail(f"expected per-token cos/sin of shape ({B} or 1, {S}, R/2) when positions is None, "
                      f"got {tuple(cs)}")
        else:
            if len(cs) != 2:
                _fail(f"expected cos/sin cache tables of shape (T, R/2) when positions is given, got {tuple(cs)}")
            if pos_t is None and pos_off + S > cs[0]:
                _fail(f"expected offset + S <= table length, got {pos_off} + {S} > {cs[0]}")
            if pos_t is not None and dev.type == "cpu" and pos_t.numel() and S and not torch.compiler.is_compiling():
                # Tensor positions index the table: checked on the host for CPU tensors (an index
                # past either end would wrap or fail deep in the fallback, or read out of bounds in
                # the interpreted kernel); not on accelerators (that would be a host sync).
                low, high = int(pos_t.min()), int(pos_t.max()) + (S - 1 if pos_t.dim() == 1 else 0)
                if low < 0 or high >= cs[0]:
                    _fail(f"expected tensor positions in [0, table length {cs[0]}), got positions {low}..{high}")
        # The kernel needs the last dim unit-stride and cos/sin sharing strides; tables are small,
        # so a copy here is cheap (q/k are never copied for this).
        st = cos.stride()
        if st != sin.stride() or (st and st[-1] != 1):
            cos, sin = cos.contiguous(), sin.contiguous()
    else:
        if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or not inv_freq.is_floating_point():
            _fail(f"expected inv_freq a 1-D floating tensor (R/2,), got {getattr(inv_freq, 'shape', inv_freq)}")
        if inv_freq.device != dev:
            _fail(f"expected inv_freq on q's device {dev}, got {inv_freq.device}")
        if positions is None:
            _fail("expected positions (int, (B,) or (B, S) tensor) with inv_freq=, got None")
        half = inv_freq.shape[0]
        if inv_freq.stride(0) != 1:
            inv_freq = inv_freq.contiguous()
    if half < 1:
        _fail(f"expected a positive even rotary dim R = 2 * cos.shape[-1], got R = {2 * half}")
    if 2 * half > D:
        hint = ""
        if cos is not None and 2 * D >= 2 * half > D:  # wider than R/2 can be: HF/Liger full tables
            first = "[..., ::2]" if interleaved else f"[..., :{half // 2}]"
            hint = (f"; cos/sin with {half} entries per row look like HF's full tables ({'repeat_interleave' if interleaved else 'cat'}"
                    f"(freqs, freqs)): rotary_fused takes half tables (R/2 entries), e.g. cos{first}, sin{first}")
        _fail(f"expected rotary dim R = 2 * {half} = {2 * half} <= head dim D = {D}{hint}")
    if isinstance(scale, Tensor) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail(f"expected a Python number scale, got {type(scale).__name__}")
    return RopeArgs(q, k, cos, sin, inv_freq, pos_t, pos_off, float(scale), bool(interleaved), bool(conjugate))


# ------------------------------------------------------------------------------------------
# Implementations (kernel or PyTorch fallback); shared by the fast path and the custom ops
# ------------------------------------------------------------------------------------------


_empty_like = torch.empty_like  # module-level so tests can poison fresh outputs


def _alloc_like(x: Tensor) -> Tensor:
    """Output buffer: ``empty_like`` keeps the input's strides when it is dense (so HF's
    (B, H, S, D) view over (B, S, H, D) memory gets an output in the same memory order);
    otherwise (padded views: empty_like's own rule; non-unit last stride: here) a contiguous
    (B, H, S, D) tensor.  The fake impl uses the same rule, so compiled and eager agree."""
    if x.stride(-1) == 1:
        return _empty_like(x)
    return _empty_like(x, memory_format=torch.contiguous_format)


def _torch_cos_sin(a: RopeArgs, cdt: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(Bc, 1, S, R/2) cos/sin in ``cdt`` with the kernel's semantics (PyTorch fallback)."""
    cos, sin, inv_freq, pos_t = a.cos, a.sin, a.inv_freq, a.positions
    if inv_freq is None and cos.dim() == 3:  # per-token tables (Bc, S, R/2)
        c, s = cos.to(cdt), sin.to(cdt)
    else:
        ar = torch.arange(a.q.shape[2], device=a.q.device)
        if pos_t is None:
            pos = (ar + a.offset)[None]
        elif pos_t.dim() == 1:
            pos = pos_t.long()[:, None] + ar
        else:
            pos = pos_t.long()
        if inv_freq is not None:
            ang = (pos.float()[..., None] * inv_freq.float()).to(cdt)  # float32 angle, as the kernel
            c, s = torch.cos(ang), torch.sin(ang)
        else:
            c, s = cos.to(cdt)[pos], sin.to(cdt)[pos]
    if a.scale != 1.0:
        c, s = c * a.scale, s * a.scale
    return c[:, None], s[:, None]


def _torch_rotate_into(x: Tensor, out: Tensor, c: Tensor, s: Tensor, interleaved: bool, conjugate: bool):
    half = c.shape[-1]
    r = 2 * half
    xr = x[..., :r].to(c.dtype)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    if conjugate:
        s = -s
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if interleaved:
        out[..., :r] = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        out[..., :half] = y1
        out[..., half:r] = y2
    if out is not x and r < x.shape[-1]:
        out[..., r:] = x[..., r:]


def _launch_key(a: RopeArgs, inplace: bool) -> Optional[tuple]:
    """The key ``rotary_fused`` computes for the call these arguments were validated from (the
    position form as given: a tensor, None with per-token tables, else the int offset)."""
    if a.positions is not None:
        positions = a.positions
    elif a.cos is not None and a.cos.dim() == 3:
        positions = None
    else:
        positions = a.offset
    return key_of(a.q, a.k, a.cos, a.sin, a.inv_freq, positions, a.scale, a.interleaved, inplace, a.conjugate)


def _run(a: RopeArgs, qo: Tensor, ko: Tensor) -> None:
    """Rotate ``a.q``/``a.k`` into ``qo``/``ko`` (which may be they).  All have stride(-1) == 1.

    The one way to the kernel: the launch kept for this call's key, else a launch through Triton
    that is kept; where the kernel cannot run, the same math in PyTorch."""
    q, k = a.q, a.k
    if kernel_can_run(q):
        key = _launch_key(a, qo is q)
        kept = None if key is None else LAUNCHES.get(key)
        if kept is None or not kept(q, k, qo, ko, a.cos, a.sin, a.inv_freq, a.positions, a.offset, a.scale):
            (_triton or _kernel_module()).launch(a, qo, ko, key)
        return
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = _torch_cos_sin(a, cdt)
    _torch_rotate_into(q, qo, c, s, a.interleaved, a.conjugate)
    _torch_rotate_into(k, ko, c, s, a.interleaved, a.conjugate)


def _rotate(a: RopeArgs) -> Tuple[Tensor, Tensor]:
    """Out of place.  A q or k whose last dim is not unit-stride (HF never makes one) is copied
    first; its output is then contiguous, as ``_alloc_like`` (the fake impl's rule) says."""
    if a.q.stride(-1) != 1 or a.k.stride(-1) != 1:
        a = a._replace(q=a.q if a.q.stride(-1) == 1 else a.q.contiguous(),
                       k=a.k if a.k.stride(-1) == 1 else a.k.contiguous())
    qo, ko = _empty_like(a.q), _empty_like(a.k)
    _run(a, qo, ko)
    return qo, ko


def _rotate_(a: RopeArgs) -> None:
    """In place (a non-unit last-dim stride: out of place, then copied back)."""
    q, k = a.q, a.k
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        qo, ko = _rotate(a)
        q.copy_(qo)
        k.copy_(ko)
        return
    _run(a, q, k)


# ------------------------------------------------------------------------------------------
# Custom ops (what torch.compile sees) and the one autograd definition
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("torchembed::rotary", mutates_args=())
def _rotary_op(
    q: Tensor,
    k: Tensor,
    cos: Optional[Tensor],
    sin: Optional[Tensor],
    inv_freq: Optional[Tensor],
    positions: Optional[Tensor],
    pos_offset: int,
    scale: float,
    interleaved: bool,
    conjugate: bool,
) -> Tuple[Tensor, Tensor]:
    return _rotate(RopeArgs(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate))


@_rotary_op.register_fake
def _rotary_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    return _alloc_like(q), _alloc_like(k)


@torch.library.custom_op("torchembed::rotary_", mutates_args=("q", "k"))
def _rotary_inplace_op(
    q: Tensor,
    k: Tensor,
    cos: Optional[Tensor],
    sin: Optional[Tensor],
    inv_freq: Optional[Tensor],
    positions: Optional[Tensor],
    pos_offset: int,
    scale: float,
    interleaved: bool,
    conjugate: bool,
) -> None:
    _rotate_(RopeArgs(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate))


@_rotary_inplace_op.register_fake
def _rotary_inplace_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    return None


class _Rotary(torch.autograd.Function):
    """The autograd of the out-of-place rotation, once: eager calls apply this Function (no
    custom-op dispatch, whose Python cost is several times a decode-sized kernel); the custom op
    ``torchembed::rotary`` registers the same ``setup_context`` and ``backward`` for torch.compile.

    The rotation is orthogonal (times ``scale``): the gradient of q/k is the conjugate rotation of
    the incoming gradient, the same kernel with ``conjugate`` flipped.  cos/sin/inv_freq/positions
    get no gradient (constants).  Under ``create_graph=True`` the backward is itself differentiable.
    """

    @staticmethod
    def forward(q, k, cos, sin, inv_freq, positions, offset, scale, interleaved, conjugate):
        return _rotate(RopeArgs(q, k, cos, sin, inv_freq, positions, offset, scale, interleaved, conjugate))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, cos, sin, inv_freq, positions, offset, scale, interleaved, conjugate = inputs
        ctx.save_for_backward(cos, sin, inv_freq, positions)
        ctx.consts = (offset, scale, interleaved, conjugate)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, inv_freq, positions = ctx.saved_tensors
        offset, scale, interleaved, conjugate = ctx.consts
        a = RopeArgs(grad_q, grad_k, cos, sin, inv_freq, positions, offset, scale, interleaved, not conjugate)
        if type(grad_q) is not Tensor or type(grad_k) is not Tensor or torch.compiler.is_compiling():
            dq, dk = torch.ops.torchembed.rotary(*a)  # traced (compile) or a tensor subclass: the op
        elif torch.is_grad_enabled():  # create_graph=True: stay differentiable
            dq, dk = _Rotary.apply(*a)
        else:
            dq, dk = _rotate(a)
        return dq, dk, None, None, None, None, None, None, None, None


_rotary_op.register_autograd(_Rotary.backward, setup_context=_Rotary.setup_context)


# ------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------


def needs_grad(q: Tensor, k: Tensor) -> bool:
    """Autograd records this call (q and k may be anything here: validation comes later)."""
    return torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False))


def replay_kept(key: Optional[tuple], q: Tensor, k: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
                inv_freq: Optional[Tensor], positions: Union[None, int, Tensor], scale: float,
                inplace: bool) -> Optional[Tuple[Tensor, Tensor]]:
    """``rotary_fused``'s result from the launch kept under ``key`` (:func:`rope_launches.key_of` of
    these arguments), with no validation (the key implies it); None where nothing is kept or the
    kernel cannot run: the caller goes the validated way. For calls that need no gradient
    (:func:`needs_grad` false: the caller checks, before computing the key)."""
    kept = LAUNCHES.get(key)
    # A kept launch means the kernel ran on this device; only the switch can have changed since.
    if kept is None or _triton_disabled():
        return None
    qo, ko = (q, k) if inplace else (_empty_like(q), _empty_like(k))
    pos_t, offset = (None, positions) if type(positions) is int else (positions, 0)
    if kept(q, k, qo, ko, cos, sin, inv_freq, pos_t, offset, scale):
        return qo, ko
    return None


def rotary_tables_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """The patched HF attention's call at inference: rotate q and k in place by per-token tables.

    No validation, no autograd, no fallback: the caller guarantees q ``(B, Hq, S, D)`` and k
    ``(B, Hk, S, D)`` on a device the kernel runs on, unit last-dim stride, cos/sin
    ``(B or 1, S, R/2)`` with unit last-dim stride, and that nothing needs gradients.  Its key (a
    shorter one than ``rotary_fused``'s, tagged apart) is looked up in the same launch cache.
    """
    key = ("tables_", q.shape, k.shape, q.stride(), k.stride(), cos.shape, cos.stride(), sin.stride(), q.dtype,
           cos.dtype, sin.dtype, q.device)
    kept = LAUNCHES.get(key)
    if kept is None or not kept(q, k, q, k, cos, sin, None, None, 0, 1.0):
        (_triton or _kernel_module()).launch(RopeArgs(q, k, cos, sin, None, None, 0, 1.0, False, False), q, k, key)
    return q, k


def rotary_fused(
    q: Tensor,
    k: Tensor,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
    *,
    inv_freq: Optional[Tensor] = None,
    scale: float = 1.0,
    positions: Union[None, int, Tensor] = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Apply rotary position embedding to q and k with one fused kernel launch.

    Args:
        q: ``(B, Hq, S, D)``; any strides with the last dim unit-stride (HF's transposed
            ``(B, S, H, D)`` memory works without a copy).  A tensor whose last dim is not
            unit-stride is copied once (documented fallback).
        k: ``(B, Hk, S, D)``, same dtype/device/B/S/D; ``Hk`` may differ (GQA).
        cos, sin: angle tables, ``R/2`` entries per row (R = rotary dim <= D; dims [R, D)
            pass through).  With ``positions=None``: per-token tables ``(B or 1, S, R/2)`` (the
            HF mode).  With positions: cache tables ``(T, R/2)`` indexed by position.
        inv_freq: ``(R/2,)`` instead of cos/sin (needs positions): the kernel computes
            ``angle = pos * inv_freq`` in float32, ``c, s = cos(angle) * scale, sin(angle) * scale``.
        scale: multiplies cos and sin (both modes; e.g. HF's attention_scaling).
        positions: None; an int offset (pos = offset + s); an integer ``(B,)`` tensor of
            per-sequence offsets (pos = positions[b] + s); or integer ``(B or 1, S)`` position
            ids (pos = positions[b, s]).  Out-of-range tensor positions are not checked (no sync).
        interleaved: GPT-J pairing ``(2j, 2j+1)`` instead of ``(j, j + R/2)``.
        inplace: write into q and k and return them; otherwise new tensors are returned
            (``empty_like`` layout: same strides as dense inputs, else contiguous).
        conjugate: rotate by the negative angle (the inverse rotation).

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and dtype.  Math in float32 (float64 for
        float64 inputs), rounded once on store.

    Autograd: gradients flow to q and k (the conjugate rotation of the incoming gradients);
    cos/sin/inv_freq/positions get none.

    Raises:
        ValueError: on any shape/dtype/device mismatch, naming the expected and given values.
    """
    compiling = torch.compiler.is_compiling()
    if not compiling and not needs_grad(q, k):  # a call like one launched before: that launch again, at once
        key = key_of(q, k, cos, sin, inv_freq, positions, scale, interleaved, inplace, conjugate)
        if key is not None:
            out = replay_kept(key, q, k, cos, sin, inv_freq, positions, float(scale), inplace)
            if out is not None:
                return out
    a = _validate(q, k, cos, sin, inv_freq, positions, scale, interleaved, conjugate)
    inplace = bool(inplace)
    recorded = needs_grad(q, k)
    if not recorded and not compiling:
        if inplace:
            _rotate_(a)
            return q, k
        return _rotate(a)
    if not recorded:  # compiling, nothing to differentiate
        if inplace:
            torch.ops.torchembed.rotary_(*a)
            return q, k
        return torch.ops.torchembed.rotary(*a)
    rotate = torch.ops.torchembed.rotary if compiling else _Rotary.apply
    if inplace:  # a mutating op has no autograd formula: out of place, then copy_ (which autograd tracks)
        qo, ko = rotate(*a)
        q.copy_(qo)
        k.copy_(ko)
        return q, k
    return rotate(*a)
