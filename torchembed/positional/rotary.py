"""``RotaryEmbedding``: rotary position embedding for queries and keys.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchembed import kernels
from torchembed.functional.rope import (apply_rotary_qk, check_base, check_nonnegative, is_position_dtype, rope_cos_sin,
                                        rope_inv_freq, rope_positions)
from torchembed.kernels.launch import triton_available
from torchembed.kernels.route import check_fused, refuse, use_rope_kernel

__all__ = ["RotaryEmbedding"]

_UNSET = object()


class RotaryEmbedding(nn.Module):
    """Rotate query/key features in 2D subspaces by position-dependent angles.

    ``<R_m q, R_n k>`` depends only on ``m - n``; norms are preserved; position 0 is the identity. The module has no
    parameters: ``inv_freq`` and the cos/sin cache are non-persistent float32 buffers (never in ``state_dict``), and
    the cache grows by itself past ``max_seq_len``.

    Args:
        dim: head dim ``d`` (even); the rotary dim unless ``rotary_dim`` is given.
        max_seq_len: positions to precompute; longer sequences extend the cache.
        base: ``theta`` of the frequency progression (LLaMA 3 uses 500000).
        fused: the fused Triton kernel (q and k in one launch): ``None`` where it can run (CUDA tensors, Triton
            installed; CPU tensors under ``TRITON_INTERPRET=1``) and the PyTorch path elsewhere; ``True`` always
            (``FusedUnavailableError`` where it cannot run); ``False`` (the default) never. Both compute in float32.
        device: where to build the buffers.
        rotary_dim: rotate only the first ``rotary_dim`` features (partial rotary); default ``dim``.
        interleaved: pair features ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + r/2)`` (LLaMA).
        rope_parameters: HF-style frequency scaling, e.g. ``{"rope_type": "llama3", "factor": 8, ...}``.
        use_fused: deprecated: ``use_fused=True`` is ``fused=None``, ``use_fused=False`` is ``fused=False`` (with a
            DeprecationWarning).

    Shapes:
        ``q``: ``(..., s, d)``, ``k``: ``(..., s, d)``, the same rank, device and sequence length; outputs have the
        input shapes and dtypes. The math runs in float32 and rounds once. With shared positions (an int ``offset`` or
        ``(s,)``/``(1, s)`` ``position_ids``) the leading dims may differ (e.g. GQA heads), each tensor is rotated on
        its own. With per-sequence positions (an offset tensor or ``(b, s)`` ``position_ids``) dim 0 is the batch: q
        and k need a batch dim and the same batch size (no broadcasting of k to q's batch).

    Raises:
        ValueError: odd/non-positive ``dim``, bad ``rotary_dim``/``max_seq_len``, ``base`` not a finite number > 0.
        TypeError: ``base`` not a real number, ``fused`` not None/True/False, ``fused`` and ``use_fused`` both given.
        FusedUnavailableError: ``fused=True`` without Triton (at construction) or on tensors the kernel cannot run on
            (at the call).
    """

    def __init__(self, dim: int, max_seq_len: int = 2048, base: int = 10000, fused: bool | None = False,
                 device: torch.device | str | None = None, *, rotary_dim: int | None = None, interleaved: bool = False,
                 rope_parameters: Mapping[str, Any] | None = None, use_fused: Any = _UNSET) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0 or dim % 2:
            raise ValueError(f"RotaryEmbedding dim must be a positive even int, got {dim!r}")
        rotary_dim = dim if rotary_dim is None else rotary_dim
        if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim:
            raise ValueError(f"rotary_dim must be a positive even int <= dim={dim}, got {rotary_dim!r}")
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        check_base(base, "RotaryEmbedding base")
        if use_fused is not _UNSET:
            if fused is not False:
                raise TypeError("RotaryEmbedding: pass fused= only (use_fused is its deprecated spelling)")
            fused = None if use_fused else False
            warnings.warn(f"RotaryEmbedding(use_fused={use_fused!r}) is deprecated: pass fused={fused!r} (None: the "
                          "kernel where it can run; True: the kernel required; False: never)",
                          DeprecationWarning, stacklevel=2)
        check_fused(fused, "RotaryEmbedding fused")
        if fused and not triton_available():
            raise refuse("RotaryEmbedding(fused=True)'s kernel", "it needs Triton: pip install triton")
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
        self.dim, self.rotary_dim, self.base = dim, rotary_dim, base
        self.max_seq_len, self.fused, self.interleaved = max_seq_len, fused, interleaved
        inv_freq, self.attention_scaling = rope_inv_freq(
            rotary_dim, float(base), rope_parameters, max_position_embeddings=max_seq_len, device=device
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build_cache(max_seq_len)

    def _build_cache(self, length: int) -> None:
        positions = torch.arange(length, device=self.inv_freq.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.attention_scaling)
        self.register_buffer("cos_cached", cos, persistent=False)  # (t, r/2) float32
        self.register_buffer("sin_cached", sin, persistent=False)

    def forward(self, q: Tensor, k: Tensor, seq_dim: int = -2, *, offset: int | Tensor = 0,
                position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` and ``k``.

        Args:
            q, k: ``(..., s, d)`` with the sequence at ``seq_dim``, on this module's device.
            seq_dim: dim of ``q``/``k`` that indexes positions (not the last).
            offset: position of the first token: a non-negative int, or ``(b,)`` per sequence (KV cache), ``b`` the
                batch (dim 0 of q and k once the sequence dim is moved to -2).
            position_ids: the positions, ``(s,)`` or ``(b, s)`` with ``b = q.shape[0]`` (or 1); excludes ``offset``.

        Tensor positions must be non-negative integers: checked on the host for CPU tensors (a ValueError), not for
        accelerator tensors (no host sync on the hot path), where a negative position rotates by the negative angle.

        Returns:
            Rotated ``(q, k)``, same shapes and dtypes.

        Raises:
            TypeError: q/k not floating-point tensors, ``position_ids`` not a tensor, ``seq_dim`` not an int.
            ValueError: shapes, devices or positions that do not fit (see the class docstring), each naming what was
                expected and what was given.
        """
        kernel = None  # kernel or PyTorch: asked once per call, where first needed
        if self.fused is not False and self._kernel_first(q, seq_dim, offset, position_ids):
            kernel = use_rope_kernel(self.fused, q)
            if kernel:
                # (b, h, s, d) on the kernel: rotary_fused checks the shapes (once per layout; later calls reuse its
                # kept launch). A ValueError from it falls back to the module's own checks below, which name it in
                # its terms.
                try:
                    return self._fused(q, k, offset, position_ids, self._buffers["inv_freq"])
                except ValueError:
                    pass
        inv_freq = self.inv_freq
        seq_len = self._check(q, k, seq_dim, inv_freq)
        nd = q.dim()
        moved = seq_dim % nd != nd - 2
        if moved:
            q, k = q.movedim(seq_dim, -2), k.movedim(seq_dim, -2)
        offset, position_ids = self._positions(q, k, seq_len, offset, position_ids)
        if kernel is None:
            kernel = self.fused is not False and use_rope_kernel(self.fused, q)
        if kernel:
            q_out, k_out = self._fused(q, k, offset, position_ids, inv_freq)
        else:
            q_out, k_out = self._reference(q, k, offset, position_ids)
        if moved:
            return q_out.movedim(-2, seq_dim), k_out.movedim(-2, seq_dim)
        return q_out, k_out

    def _kernel_first(self, q: Tensor, seq_dim: int, offset: int | Tensor, position_ids: Tensor | None) -> bool:
        """A call the kernel may take before the module's checks: ``(b, h, s, d)`` with the sequence at dim 2, and
        positions the kernel reads as given (an int or CUDA ``(b,)`` offset, or CUDA position ids)."""
        if type(q) is not Tensor or q.dim() != 4 or q.shape[-1] != self.dim or (seq_dim != -2 and seq_dim != 2):
            return False
        if position_ids is None:
            return type(offset) is int or (type(offset) is Tensor and offset.is_cuda)
        return type(offset) is int and offset == 0 and type(position_ids) is Tensor and position_ids.is_cuda

    @property
    def use_fused(self) -> bool:
        """Deprecated: whether the kernel may be used (``fused`` is not False)."""
        return self.fused is not False

    def _check(self, q: Tensor, k: Tensor, seq_dim: int, inv_freq: Tensor) -> int:
        """The sequence length of valid ``q``/``k``; else the TypeError/ValueError ``forward`` names."""
        if type(q) is Tensor and type(k) is Tensor and type(seq_dim) is int:  # all valid: one pass
            qs, ks = q.shape, k.shape
            nd = len(qs)
            if (
                len(ks) == nd >= 2 and qs[-1] == ks[-1] == self.dim and -nd <= seq_dim < nd and seq_dim % nd != nd - 1
                and qs[seq_dim] == ks[seq_dim] and q.is_floating_point() and k.is_floating_point()
                and q.device == k.device == inv_freq.device
            ):
                return qs[seq_dim]
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
            if t.dim() < 2:
                raise ValueError(f"{name} must have shape (..., seq_len, dim), got {tuple(t.shape)}")
            if t.shape[-1] != self.dim:
                raise ValueError(f"{name}.shape[-1] must be dim={self.dim}, got {tuple(t.shape)}")
        device = q.device
        if k.device != device:
            raise ValueError(f"q and k must be on one device, got q on {device} and k on {k.device}")
        if inv_freq.device != device:
            raise ValueError(f"q and k are on {device} but this RotaryEmbedding's buffers are on {inv_freq.device}: "
                             f"move the module with .to({str(device)!r})")
        nd = q.dim()
        if k.dim() != nd:
            raise ValueError(f"q and k must have the same rank, got {tuple(q.shape)} and {tuple(k.shape)}")
        if not isinstance(seq_dim, int) or isinstance(seq_dim, bool):
            raise TypeError(f"seq_dim must be an int, got {type(seq_dim).__name__} {seq_dim!r}")
        if not -nd <= seq_dim < nd or seq_dim % nd == nd - 1:
            raise ValueError(f"seq_dim must index a dim of q other than the last, got {seq_dim} for rank {nd}")
        if q.shape[seq_dim] != k.shape[seq_dim]:
            raise ValueError(f"q and k must have the same sequence length at seq_dim={seq_dim}, got {tuple(q.shape)} "
                             f"and {tuple(k.shape)}")
        return q.shape[seq_dim]

    def _positions(self, q: Tensor, k: Tensor, seq_len: int, offset: int | Tensor,
                   position_ids: Tensor | None) -> tuple[int | Tensor, Tensor | None]:
        """Checked ``(offset, position_ids)`` for ``q``/``k`` of shape ``(..., s, d)`` (sequence at -2): an int or
        ``(b,)`` offset and None, or 0 and ``(s,)``/``(b, s)`` position ids."""
        if position_ids is not None:
            if not isinstance(position_ids, Tensor):
                raise TypeError(f"position_ids must be an integer tensor (s,) or (b, s), got {type(position_ids).__name__}")
            if isinstance(offset, Tensor) or offset != 0:
                raise ValueError("pass either offset or position_ids, not both")
            if not is_position_dtype(position_ids) or position_ids.dim() not in (1, 2) or position_ids.shape[-1] != seq_len:
                raise ValueError(f"position_ids must be integer (s,) or (b, s) with s={seq_len}, got "
                                 f"{position_ids.dtype} {tuple(position_ids.shape)}")
            if position_ids.dim() == 2:
                if q.dim() == 2:  # no batch dim: only positions shared by all, (1, s), fit
                    if position_ids.shape[0] != 1:
                        raise ValueError(f"position_ids (b, s) = {tuple(position_ids.shape)} need q and k with a batch "
                                         f"dim, (b, ..., s, d); got q {tuple(q.shape)} (pass (s,) position_ids for "
                                         "unbatched inputs)")
                    position_ids = position_ids[0]
                elif position_ids.shape[0] not in (1, q.shape[0]):
                    raise ValueError(f"position_ids batch {position_ids.shape[0]} does not match q.shape[0]={q.shape[0]}")
                elif position_ids.shape[0] != 1:
                    self._check_batch(q, k, "(b, s) position_ids")
            self._check_meta(position_ids, q, "position_ids")
            check_nonnegative(position_ids, "position_ids")
            return 0, position_ids
        if isinstance(offset, Tensor):
            if q.dim() < 3:
                raise ValueError("an offset tensor (per-sequence offsets) needs q and k with a batch dim, "
                                 f"(b, ..., s, d); got q {tuple(q.shape)} (pass an int offset for unbatched inputs)")
            if offset.dim() != 1 or not is_position_dtype(offset) or offset.shape[0] != q.shape[0]:
                raise ValueError(f"offset tensor must be integer (b,) with b={q.shape[0]}, got {offset.dtype} {tuple(offset.shape)}")
            self._check_batch(q, k, "per-sequence offsets")
            self._check_meta(offset, q, "offset tensor")
            check_nonnegative(offset, "offset tensor")
            return offset, None
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int or a (b,) tensor, got {offset!r}")
        return offset, None

    @staticmethod
    def _check_batch(q: Tensor, k: Tensor, what: str) -> None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"with {what}, q and k must have the same batch size (dim 0), got q {tuple(q.shape)} "
                             f"and k {tuple(k.shape)} (shapes with the sequence dim at -2)")

    @staticmethod
    def _check_meta(positions: Tensor, q: Tensor, name: str) -> None:
        if positions.is_meta and not q.is_meta:
            raise ValueError(f"{name} is on the meta device (no values) but q is on {q.device}")

    def _reference(self, q: Tensor, k: Tensor, offset: int | Tensor,
                   position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        seq_len = q.shape[-2]
        if position_ids is None and not isinstance(offset, Tensor):
            if offset + seq_len > self.cos_cached.shape[0]:  # grown geometrically: a decode loop rebuilds it rarely
                self._build_cache(max(offset + seq_len, 2 * self.cos_cached.shape[0]))
            cos = self.cos_cached[offset : offset + seq_len]
            sin = self.sin_cached[offset : offset + seq_len]
        else:
            positions = rope_positions(offset, seq_len) if position_ids is None else position_ids
            cos, sin = rope_cos_sin(self.inv_freq, positions.to(q.device), self.attention_scaling)
            if positions.dim() == 2:  # (b, s, r/2) -> (b, 1, ..., 1, s, r/2) against (b, ..., s, d)
                cos = cos.view(cos.shape[0], *([1] * (q.dim() - 3)), *cos.shape[1:])
                sin = sin.view(cos.shape)
        return apply_rotary_qk(q, k, cos, sin, interleaved=self.interleaved)

    def _fused(self, q: Tensor, k: Tensor, offset: int | Tensor, position_ids: Tensor | None,
               inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        # The kernel computes the angles from inv_freq (no table bytes read). Offsets go to it as they are
        # ((b,): pos = offset[b] + s), position ids as (1 or b, s).
        if position_ids is None:
            positions = offset
        else:
            positions = position_ids[None] if position_ids.dim() == 1 else position_ids
        if isinstance(positions, Tensor) and positions.device != q.device:
            positions = positions.to(q.device)
        qb, kb = _as_bhsd(q), _as_bhsd(k)
        kwargs = dict(inv_freq=inv_freq, scale=self.attention_scaling, positions=positions, interleaved=self.interleaved)
        if qb.shape[0] == kb.shape[0] and q.dtype == k.dtype:
            q_out, k_out = kernels.rotary_fused(qb, kb, **kwargs)
        else:  # shared positions allow q and k of different batch sizes or dtypes: one launch each
            q_out = kernels.rotary_fused(qb, qb[:, :0], **kwargs)[0]
            k_out = kernels.rotary_fused(kb, kb[:, :0], **kwargs)[0]
        if q.dim() == 4:
            return q_out, k_out
        return q_out.reshape(q.shape), k_out.reshape(k.shape)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rotary_dim={self.rotary_dim}, max_seq_len={self.max_seq_len}, base={self.base}, "
                f"interleaved={self.interleaved}, fused={self.fused}")


def _as_bhsd(x: Tensor) -> Tensor:
    """View ``(..., s, d)`` as the kernel's ``(b, h, s, d)`` (a view for 2D-4D inputs)."""
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        return x.unsqueeze(1)
    if x.dim() == 2:
        return x[None, None]
    return x.flatten(1, -3)
