"""``rotary_fused``: the fused RoPE kernel as PyTorch custom ops, plus the public entry point.

Custom ops (namespace ``torchembed``):

* ``torchembed::rotary(q, k, cos?, sin?, inv_freq?, positions?, pos_offset, scale, interleaved,
  conjugate) -> (Tensor, Tensor)``: out-of-place, with a fake (meta) impl and autograd.
* ``torchembed::rotary_(...) -> ()``: mutates q and k, with a fake impl (no autograd;
  ``rotary_fused(inplace=True)`` on tensors that need grad goes through ``rotary`` + ``copy_``).

The positions variants map onto the schema as: ``positions=None`` -> (None, 0); an int offset
-> (None, offset); a ``(B,)`` or ``(B|1, S)`` integer tensor -> (tensor, 0).  ``cos``/``sin``
or ``inv_freq`` is given, the others are None.  3-D cos/sin are per-token tables (positions
None); 2-D cos/sin are position-indexed caches (by the tensor, or by ``pos_offset + s``).

Autograd: the rotation is orthogonal (times ``scale``), so the gradient of q/k is the
*conjugate* rotation of the incoming gradient -- the same kernel with ``conjugate`` flipped.
cos/sin/inv_freq/positions get NO gradient (they are treated as constants).

Eager calls without autograd skip the custom ops; one whose signature (shapes, strides, dtypes,
devices, position form, flags) was validated and launched before replays that launch with its own
pointers, offset and scale (``_FAST``), so a decode step costs little more than the launch itself.

Devices: the Triton kernel runs where ``kernel_can_run`` says so (CUDA, or CPU under
``TRITON_INTERPRET=1``); elsewhere (CPU without the interpreter, meta, Triton missing or
``TORCHEMBED_DISABLE_TRITON=1``) the ops fall back to an equivalent pure-PyTorch computation
with the same float32 math, so ``rotary_fused`` works everywhere.
"""

import os
from collections.abc import Callable
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["rotary_fused", "rotary_tables_", "rotary_angles_", "triton_available", "interpret_mode", "kernel_can_run"]


# ------------------------------------------------------------------------------------------
# Availability switches (re-exported by torchembed.kernels).  Triton is imported lazily.
# ------------------------------------------------------------------------------------------

_TRITON_OK: Optional[bool] = None


def _env_flag(name: str, value: str = "1") -> Callable[[], bool]:
    """A reader of ``os.environ.get(name) == value`` for switches read on every call.

    ``os.environ.get`` pays for a KeyError on a missing name (about 1 us); CPython's ``os.environ``
    keeps its entries in a dict of encoded names and values, read here directly (the same dict,
    so changes show at once)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    try:
        key, expected = environ.encodekey(name), environ.encodevalue(value)
    except AttributeError:
        data = None
    if not isinstance(data, dict):
        return lambda: environ.get(name) == value
    return lambda: data.get(key) == expected


_triton_disabled = _env_flag("TORCHEMBED_DISABLE_TRITON")
_interpreting = _env_flag("TRITON_INTERPRET")


def triton_available() -> bool:
    """Whether Triton is importable (imported on the first call only; the answer is cached)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_OK = True
        except Exception:  # ImportError, or a broken install failing on import
            _TRITON_OK = False
    return _TRITON_OK


def interpret_mode() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run (slowly) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_can_run(t: Tensor) -> bool:
    """Whether the fused kernel can run on ``t``: Triton available and ``t`` on CUDA (or CPU
    under ``TRITON_INTERPRET=1``).  ``TORCHEMBED_DISABLE_TRITON=1`` forces False.  The
    environment is read on every call (well under 1 us), so switches take effect immediately."""
    if _triton_disabled() or not (_TRITON_OK or triton_available()):
        return False
    return t.is_cuda or (_interpreting() and t.device.type == "cpu")


_launch = _hot = _hot_angles = _replayer = None


def _launcher():
    global _launch
    if _launch is None:
        from torchembed.kernels.rope_triton import rope_forward

        _launch = rope_forward
    return _launch


def _replayer_of():
    global _replayer
    if _replayer is None:
        from torchembed.kernels.rope_triton import rope_replayer

        _replayer = rope_replayer
    return _replayer


def _hot_launchers():
    """Import the in-place hot paths (tables, angles) on first use."""
    global _hot, _hot_angles
    from torchembed.kernels.rope_triton import rope_angles_inplace, rope_tables_inplace

    _hot, _hot_angles = rope_tables_inplace, rope_angles_inplace
    return _hot, _hot_angles


# ------------------------------------------------------------------------------------------
# Validation (cheap: attribute reads and Python int compares only; no tensor ops, no syncs)
# ------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(f"rotary_fused: {msg}")


def _validate(q, k, cos, sin, inv_freq, positions):
    """Check the arguments; return (cos, sin, inv_freq, positions tensor or None, pos_offset).

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
        _fail(f"expected rotary dim R = 2 * {half} = {2 * half} <= head dim D = {D}")
    return cos, sin, inv_freq, pos_t, pos_off


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


def _torch_cos_sin(B, S, cos, sin, inv_freq, pos_t, pos_off, scale, cdt, device):
    """(Bc, 1, S, R/2) cos/sin in ``cdt`` with the kernel's semantics (PyTorch fallback)."""
    if inv_freq is None and cos.dim() == 3:  # per-token tables (Bc, S, R/2)
        c, s = cos.to(cdt), sin.to(cdt)
    else:
        ar = torch.arange(S, device=device)
        if pos_t is None:
            pos = (ar + pos_off)[None]
        elif pos_t.dim() == 1:
            pos = pos_t.long()[:, None] + ar
        else:
            pos = pos_t.long()
        if inv_freq is not None:
            ang = (pos.float()[..., None] * inv_freq.float()).to(cdt)  # float32 angle, as the kernel
            c, s = torch.cos(ang), torch.sin(ang)
        else:
            c, s = cos.to(cdt)[pos], sin.to(cdt)[pos]
    if scale != 1.0:
        c, s = c * scale, s * scale
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


def _run(q, k, qo, ko, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate) -> None:
    """Rotate (q, k) into (qo, ko) (which may be q, k).  All four have stride(-1) == 1."""
    if kernel_can_run(q):
        (_launch or _launcher())(q, k, qo, ko, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
        return
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = _torch_cos_sin(q.shape[0], q.shape[2], cos, sin, inv_freq, pos_t, pos_off, scale, cdt, q.device)
    _torch_rotate_into(q, qo, c, s, interleaved, conjugate)
    _torch_rotate_into(k, ko, c, s, interleaved, conjugate)


def _rotary_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate) -> Tuple[Tensor, Tensor]:
    # Fallback for a non-unit last-dim stride (rare: HF never produces it): copy THAT tensor.
    # Its output is then contiguous, as _alloc_like (the fake impl's rule) says.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    qo, ko = _empty_like(q), _empty_like(k)
    _run(q, k, qo, ko, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
    return qo, ko


def _rotary_inplace_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        # Fallback for a non-unit last-dim stride: rotate out-of-place, then copy back.
        qo, ko = _rotary_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
        q.copy_(qo)
        k.copy_(ko)
        return
    _run(q, k, q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)


# ------------------------------------------------------------------------------------------
# Custom ops (what torch.compile and autograd see)
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
    return _rotary_impl(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate)


@_rotary_op.register_fake
def _rotary_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    return _alloc_like(q), _alloc_like(k)


def _rotary_setup_context(ctx, inputs, output):
    _, _, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin, inv_freq, positions)
    ctx.consts = (pos_offset, scale, interleaved, conjugate)


def _rotary_backward(ctx, grad_q, grad_k):
    cos, sin, inv_freq, positions = ctx.saved_tensors
    pos_offset, scale, interleaved, conjugate = ctx.consts
    # d(scale * R x)/dx applied to g is scale * R^T g: the conjugate rotation, same kernel.
    dq, dk = torch.ops.torchembed.rotary(
        grad_q, grad_k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, not conjugate
    )
    return dq, dk, None, None, None, None, None, None, None, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


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
    _rotary_inplace_impl(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate)


@_rotary_inplace_op.register_fake
def _rotary_inplace_fake(q, k, cos, sin, inv_freq, positions, pos_offset, scale, interleaved, conjugate):
    return None


class _RotaryFunction(torch.autograd.Function):
    """Eager autograd for the out-of-place rotation, without the custom-op dispatcher.

    ``register_autograd`` on the custom op is what torch.compile needs, but in eager mode its
    Python dispatch costs several times the kernel; this Function calls the implementation
    directly. Backward is the conjugate rotation: the implementation directly, or this Function
    again under ``create_graph=True`` (so it is itself differentiable).
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate):
        ctx.save_for_backward(cos, sin, inv_freq, pos_t)
        ctx.consts = (pos_off, scale, interleaved, conjugate)
        return _rotary_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin, inv_freq, pos_t = ctx.saved_tensors
        pos_off, scale, interleaved, conjugate = ctx.consts
        args = (grad_q, grad_k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, not conjugate)
        # create_graph=True (grad mode on here): stay differentiable; otherwise the kernel directly
        # (a nested Function.apply costs host time on every backward).
        dq, dk = _RotaryFunction.apply(*args) if torch.is_grad_enabled() else _rotary_impl(*args)
        return dq, dk, None, None, None, None, None, None, None, None


def rotary_tables_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Hot path for per-token float32 tables: rotate q and k in place.

    No validation, no autograd, no fallback: the caller guarantees q ``(B, Hq, S, D)`` and k
    ``(B, Hk, S, D)`` on a device the kernel runs on, unit last-dim stride, cos/sin
    ``(B or 1, S, R/2)`` with unit last-dim stride, and that nothing needs gradients.
    """
    (_hot or _hot_launchers()[0])(q, k, cos, sin)
    return q, k


def rotary_angles_(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor) -> Tuple[Tensor, Tensor]:
    """Hot path of the patched HF attention at inference: rotate q and k in place by the angles
    ``positions * inv_freq``, computed in the kernel (no tables read).

    No validation, no autograd, no fallback: the caller guarantees q ``(B, Hq, S, D)`` and k
    ``(B, Hk, S, D)`` on a device the kernel runs on, unit last-dim stride, integer positions
    ``(B or 1, S)`` and float32 ``inv_freq`` ``(R/2,)`` (contiguous) on the same device, and that
    nothing needs gradients.
    """
    (_hot_angles or _hot_launchers()[1])(q, k, positions, inv_freq)
    return q, k


# ------------------------------------------------------------------------------------------
# Replays of validated eager calls without autograd
# ------------------------------------------------------------------------------------------

# Call signature -> replay (``rope_triton.rope_replayer``): a call whose signature was validated
# and launched before skips validation and the launch set-up.  Cleared by clear_launch_caches.
_FAST: dict = {}
_FAST_MAX = 4096
_I32 = 2**31


def _tensor_key(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _signature(q, k, cos, sin, inv_freq, positions, interleaved, inplace, conjugate) -> Optional[tuple]:
    """Everything ``_validate`` and the launch depend on but the pointers, the int offset's value
    (its Triton specialisation instead) and scale; None for calls that are never replayed: tensor
    subclasses, flags that are not bools, a negative or out-of-table int offset, positions checked on
    the host."""
    if type(q) is not Tensor or type(k) is not Tensor or q.dim() != 4:
        return None
    if type(interleaved) is not bool or type(inplace) is not bool or type(conjugate) is not bool:
        return None
    if positions is None:
        pos = None
    elif type(positions) is int:
        if positions < 0 or (cos is not None and type(cos) is Tensor and positions + q.shape[2] > cos.shape[0]):
            return None
        pos = (positions == 1, positions % 16 == 0, positions < _I32)
    elif type(positions) is Tensor:
        if cos is not None and not q.is_cuda:  # CPU positions indexing a table: range-checked
            return None
        pos = _tensor_key(positions)
    else:
        return None
    if inv_freq is not None:
        if cos is not None or sin is not None or type(inv_freq) is not Tensor:
            return None
        angles = _tensor_key(inv_freq)
    elif type(cos) is Tensor and type(sin) is Tensor:
        angles = (_tensor_key(cos), _tensor_key(sin))
    else:
        return None
    return (q.shape, k.shape, q.stride(), k.stride(), q.dtype, k.dtype, q.device, k.device, angles, pos,
            interleaved, inplace, conjugate)


def _record(signature, q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, inplace, conjugate):
    """Launch a validated call through ``rope_replayer`` and keep its replay; (q_out, k_out)."""
    qo, ko = (q, k) if inplace else (_empty_like(q), _empty_like(k))
    replay = _replayer_of()(q, k, qo, ko, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
    if replay is not None:
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[signature] = replay
    return qo, ko


# ------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------


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
    # REPLAY (eager, no autograd): a call with the signature of one validated and launched before
    # launches again at once, with this call's pointers, offset and scale.
    signature = None if compiling else _signature(q, k, cos, sin, inv_freq, positions, interleaved, inplace, conjugate)
    grad = torch.is_grad_enabled()
    if signature is not None and not (grad and (q.requires_grad or k.requires_grad)):
        replay = _FAST.get(signature)
        if replay is not None and kernel_can_run(q):
            pos_t, pos_off = (None, positions) if type(positions) is int else (positions, 0)
            qo, ko = (q, k) if inplace else (_empty_like(q), _empty_like(k))
            if replay(q, k, qo, ko, cos, sin, inv_freq, pos_t, pos_off, float(scale)):
                return qo, ko

    cos_in, sin_in, inv_freq_in = cos, sin, inv_freq
    cos, sin, inv_freq, pos_t, pos_off = _validate(q, k, cos, sin, inv_freq, positions)
    scale = float(scale)
    interleaved, inplace, conjugate = bool(interleaved), bool(inplace), bool(conjugate)
    needs_grad = grad and (q.requires_grad or k.requires_grad)

    # FAST PATH (eager, no autograd): skip the custom-op dispatcher -- its Python dispatch costs
    # several times the kernel launch itself at decode sizes -- and call the implementation
    # directly.  The custom ops below are only needed for torch.compile (tracing through the
    # fake impl) and autograd (register_autograd); the result is identical either way.
    if not needs_grad and not compiling:
        if (signature is not None and cos is cos_in and sin is sin_in and inv_freq is inv_freq_in
                and q.stride(-1) == 1 and k.stride(-1) == 1 and kernel_can_run(q)):
            return _record(signature, q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, inplace, conjugate)
        if inplace:
            _rotary_inplace_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
            return q, k
        return _rotary_impl(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)

    # Eager with autograd: a plain autograd.Function (no dispatcher); compiled: the custom ops.
    rotate = torch.ops.torchembed.rotary if compiling else _RotaryFunction.apply
    if inplace:
        if needs_grad:
            # Mutating custom ops have no autograd formula: go out-of-place, then copy_ (which
            # autograd tracks), preserving in-place semantics.
            qo, ko = rotate(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
            q.copy_(qo)
            k.copy_(ko)
        else:
            torch.ops.torchembed.rotary_(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
        return q, k
    return rotate(q, k, cos, sin, inv_freq, pos_t, pos_off, scale, interleaved, conjugate)
