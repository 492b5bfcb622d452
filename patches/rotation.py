"""Rotation helpers: recognise upstream's by what they compute, and torchembed's replacement.

HF attention code rotates q and k with a module-level helper (``apply_rotary_pos_emb`` and
relatives) fed with ``cos``/``sin`` tables that the model's rotary module (or the attention
itself) builds. Families differ in how the tables are laid out and which features are paired;
a release may rename, wrap or restructure the helper. Instead of a list of names, torchembed
*probes* each candidate helper once: it calls it in float64 on random inputs built for each known
way of rotating and keeps the one whose result matches to 1e-12:

======================  ==========================================  ==========================
table layout            width ``w`` of cos/sin for ``r`` rotated     families
======================  ==========================================  ==========================
``cat``                 ``r``: ``(θ_0..θ_{r/2-1}, θ_0..θ_{r/2-1})``  LLaMA and most others, GLM
``repeat``              ``r``: ``(θ_0, θ_0, θ_1, θ_1, ...)``         Cohere
``half``                ``r/2``: ``(θ_0..θ_{r/2-1})``                GPT-J, CodeGen
======================  ==========================================  ==========================

pairing: ``half`` rotates ``(x_i, x_{i+r/2})`` (GPT-NeoX/LLaMA), ``interleaved`` rotates
``(x_{2i}, x_{2i+1})`` in place (GPT-J, Cohere, GLM), ``deinterleave`` rotates ``(x_{2i}, x_{2i+1})``
and writes the results in half-split order (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``).
A helper that also rotates only the first ``r`` features of a wider q (GLM, partial rotary inside
the helper) is recorded as ``partial``. Calling conventions are read from the parameter names:
``(q, k, cos, sin, ...)`` returning ``(q, k)``, ``(tensor, sin, cos)`` or ``(x, cos, sin, ...)``
returning one tensor. Anything else is not recognised, and the model is not patched.

The replacement (:class:`RotaryHelper`) rotates with the fused Triton kernel where it can run and
the float32 PyTorch reference elsewhere; both compute in float32 and round once.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchembed import kernels
from torchembed.functional.rope import apply_rotary

__all__ = ["Rotation", "RotaryHelper", "explain", "recognize", "is_rotation_name"]

LAYOUTS = ("cat", "repeat", "half")
PAIRINGS = ("half", "interleaved", "deinterleave")
_CONVENTIONS = {  # leading parameter names -> convention
    ("q", "k", "cos", "sin"): "qk",
    ("tensor", "sin", "cos"): "x_sin_cos",
    ("x", "sin", "cos"): "x_sin_cos",
    ("x", "cos", "sin"): "x_cos_sin",
    ("tensor", "cos", "sin"): "x_cos_sin",
}
# parameters a helper may have after the leading ones (all with defaults): upstream's own
_KNOWN_EXTRA = {"unsqueeze_dim", "position_ids"}


def is_rotation_name(name: str) -> bool:
    """A global's name that may be a rotation helper (``apply_rotary_pos_emb``, ``apply_rope`` ...)."""
    lowered = name.lower()
    return ("rotary" in lowered or "rope" in lowered) and not lowered.isupper()


@dataclass(frozen=True)
class Rotation:
    """How an upstream helper rotates, as found by :func:`recognize`."""

    convention: str  # "qk" | "x_sin_cos" | "x_cos_sin"
    layout: str  # one of LAYOUTS
    pairing: str  # one of PAIRINGS
    partial: bool  # rotates the first r features of a wider input, the rest pass through
    params: tuple[str, ...]  # the helper's parameter names
    conjugate: bool = False  # rotates by -theta (a rotate_half written the other way round)
    trailing: bool = False  # with partial: rotates the last r features, the leading ones pass (DeepSeek-V4)

    def rotary_dim(self, table_width: int) -> int:
        return 2 * table_width if self.layout == "half" else table_width

    def half_tables(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``(..., w)`` tables in this layout -> the ``(..., r/2)`` angles' cos and sin (views)."""
        if self.layout == "cat":
            half = cos.shape[-1] // 2
            return cos[..., :half], sin[..., :half]
        if self.layout == "repeat":
            return cos[..., ::2], sin[..., ::2]
        return cos, sin

    def describe(self) -> str:
        part = (", partial (trailing features)" if self.trailing else ", partial") if self.partial else ""
        sign = ", by -theta" if self.conjugate else ""
        return f"{self.layout} tables, {self.pairing} pairing{part}{sign}"


# -- recognition ---------------------------------------------------------------------------------


def _parameters(helper: Any) -> tuple[str, ...] | None:
    target = helper.forward if isinstance(helper, torch.nn.Module) else helper
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _convention(params: tuple[str, ...]) -> str | None:
    for lead, convention in _CONVENTIONS.items():
        if params[: len(lead)] == lead and set(params[len(lead):]) <= _KNOWN_EXTRA:
            return convention
    return None


def _tables(theta: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    if layout == "cat":
        theta = torch.cat((theta, theta), dim=-1)
    elif layout == "repeat":
        theta = theta.repeat_interleave(2, dim=-1)
    return theta.cos(), theta.sin()


def reference_rotate(x: Tensor, cos: Tensor, sin: Tensor, pairing: str, conjugate: bool = False,
                     trailing: bool = False) -> Tensor:
    """Float64-capable reference: rotate the first (``trailing``: last) ``r = 2 * cos.shape[-1]``
    features of ``x`` ``(b, h, s, d)`` by half tables ``(b, 1, s, r/2)`` with ``pairing``."""
    if trailing and x.shape[-1] > 2 * cos.shape[-1]:
        rot = 2 * cos.shape[-1]
        return torch.cat((x[..., :-rot], reference_rotate(x[..., -rot:], cos, sin, pairing, conjugate)), dim=-1)
    if pairing == "deinterleave":
        rot = 2 * cos.shape[-1]
        x = torch.cat((_deinterleave(x[..., :rot]), x[..., rot:]), dim=-1)
        pairing = "half"
    return apply_rotary(x, cos, sin, interleaved=pairing == "interleaved", conjugate=conjugate)


def _deinterleave(x: Tensor) -> Tensor:
    """``(x_0, x_1, x_2, x_3, ...)`` -> ``(x_0, x_2, ..., x_1, x_3, ...)``."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _call(helper: Callable, rotation_params: tuple[str, ...], convention: str, q: Tensor, k: Tensor, cos: Tensor,
          sin: Tensor) -> tuple[Tensor, Tensor]:
    """Call an upstream helper on (b, h, s, d) q/k and (b, s, w) tables; its q/k results."""
    if convention == "qk":
        out = helper(q, k, cos, sin)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("not a (q, k) pair")
        return out
    tables = (sin, cos) if convention == "x_sin_cos" else (cos, sin)
    if "unsqueeze_dim" in rotation_params:  # (b, h, s, d) against tables unsqueezed at dim 1
        return helper(q, *tables), helper(k, *tables)
    # GPT-J style: (b, s, h, d) against tables broadcast over the heads
    return tuple(helper(x.transpose(1, 2), *tables).transpose(1, 2) for x in (q, k))  # type: ignore[return-value]


def _matches(helper: Callable, params: tuple[str, ...], convention: str, candidate: tuple[str, str, bool],
             feature_dim: int, half: int, gen: torch.Generator, trailing: bool = False) -> bool:
    """Whether ``helper`` computes ``candidate`` = (layout, pairing, conjugate) on fresh inputs.

    Float32 inputs (helpers that cast to float32 inside are recognised too), compared with the
    float64 rotation at 1e-5: a different way of rotating is off by O(1)."""
    layout, pairing, conjugate = candidate
    batch, heads, seq = 2, 3, 5
    theta = torch.rand(batch, seq, half, generator=gen, dtype=torch.float64) * 6.0 - 3.0
    cos, sin = (t.float() for t in _tables(theta, layout))
    q = torch.randn(batch, heads, seq, feature_dim, generator=gen, dtype=torch.float32)
    k = torch.randn(batch, 1 if convention == "qk" else heads, seq, feature_dim, generator=gen, dtype=torch.float32)
    try:
        with torch.no_grad():
            got_q, got_k = _call(helper, params, convention, q, k, cos, sin)
    except Exception:  # the helper rejects these inputs: not this way of rotating
        return False
    c, s = theta.cos()[:, None], theta.sin()[:, None]
    want_q, want_k = (reference_rotate(x.double(), c, s, pairing, conjugate, trailing) for x in (q, k))
    return all(
        isinstance(got, Tensor) and got.shape == want.shape and got.is_floating_point()
        and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
        for got, want in ((got_q, want_q), (got_k, want_k))
    )


_RECOGNIZED: dict[int, tuple[Any, Rotation | None]] = {}


def explain(helper: Any) -> str:
    """Why ``helper`` is not recognised, in a few words (for error messages and ``list --all``)."""
    params = _parameters(helper)
    name = getattr(helper, "__qualname__", type(helper).__name__)
    if params is None:
        return f"{name} has no inspectable signature"
    if any("freqs_cis" in p or "freqs" == p for p in params):
        return f"{name}({', '.join(params)}) rotates by complex-valued frequencies, which torchembed does not handle"
    if not _convention(params):
        return f"{name}({', '.join(params)}) is not a calling convention torchembed knows (e.g. multimodal M-RoPE sections)"
    return f"{name} computes none of the rotations torchembed knows"


def recognize(helper: Any) -> Rotation | None:
    """How ``helper`` rotates, or None if it computes none of the known rotations (cached)."""
    hit = _RECOGNIZED.get(id(helper))
    if hit is not None and hit[0] is helper:
        return hit[1]
    with torch.device("cpu"):  # also where a model is built under a meta (or CUDA) default device
        rotation = _probe(helper)
    _RECOGNIZED[id(helper)] = (helper, rotation)
    return rotation


def _probe(helper: Any) -> Rotation | None:
    if not callable(helper) or isinstance(helper, type):
        return None
    params = _parameters(helper)
    convention = params and _convention(params)
    if not convention:
        return None
    gen = torch.Generator().manual_seed(0)
    half = 4
    found = [
        candidate
        for candidate in itertools.product(LAYOUTS, PAIRINGS, (False, True))
        if _matches(helper, params, convention, candidate, 2 * half, half, gen)
    ]
    if len(found) != 1:  # none, or ambiguous (a helper that ignores its inputs)
        return None
    layout, pairing, conjugate = found[0]
    leading = _matches(helper, params, convention, found[0], 4 * half, half, gen)
    trailing = not leading and _matches(helper, params, convention, found[0], 4 * half, half, gen, trailing=True)
    return Rotation(convention, layout, pairing, leading or trailing, params, conjugate, trailing)


# -- replacement -----------------------------------------------------------------------------------


def _unknown(kwargs: dict, known: tuple[str, ...]) -> bool:
    """A keyword other than ``known`` (written so that dynamo traces it: torch 2.8 breaks the graph
    on ``kwargs.keys() - {...}``)."""
    return any(key not in known for key in kwargs)


class RotaryHelper:
    """torchembed's drop-in for one upstream rotation helper (same parameters, same results).

    ``q``: ``(b, h, s, d)`` (or ``(b, s, h, d)`` with ``unsqueeze_dim=2``), ``k`` likewise with its
    own head count; ``cos``/``sin``: upstream's ``(b, s, w)`` tables in the helper's layout. The
    rotation runs in float32 and rounds once: on the fused Triton kernel (q and k in one launch)
    where it can run and ``fused`` is not False, on :func:`~torchembed.functional.apply_rotary`
    elsewhere. At inference on the kernel, HF's usual call rotates q and k in place (upstream binds
    its names to the returned tensors, which are they). Inputs the helper was not recognised for
    (other table ranks, tables that do not match q's batch and sequence, a feature dim the helper
    would not rotate) go to ``upstream`` unchanged.

    One instance per (rotation, upstream, fused) (:meth:`get`), so the rebound attention code is
    shared by every model patched the same way; it pickles as those three.
    """

    _INSTANCES: dict[tuple, "RotaryHelper"] = {}

    def __init__(self, rotation: Rotation, upstream: Callable, fused: bool | None) -> None:
        self.rotation, self.upstream, self.fused = rotation, upstream, fused
        self._unsqueeze_index = rotation.params.index("unsqueeze_dim") if "unsqueeze_dim" in rotation.params else None
        self.__name__ = self.__qualname__ = f"torchembed_{getattr(upstream, '__name__', 'rotary')}"
        # The in-place kernel hot path serves HF's usual call, helper(q, k, cos, sin) on cat tables
        # with half-split pairing; _views keeps the last tables' half views (every layer of a
        # forward gets the same tables).
        self._hot = (fused is not False and rotation.convention == "qk" and rotation.layout == "cat"
                     and rotation.pairing == "half" and not rotation.conjugate)
        self._views: tuple | None = None

    @classmethod
    def get(cls, rotation: Rotation, upstream: Callable, fused: bool | None) -> "RotaryHelper":
        key = (rotation, id(upstream), fused)
        helper = cls._INSTANCES.get(key)
        if helper is None or helper.upstream is not upstream:
            helper = cls._INSTANCES[key] = cls(rotation, upstream, fused)
        return helper

    def __reduce__(self) -> tuple:
        return (RotaryHelper.get, (self.rotation, self.upstream, self.fused))

    def __repr__(self) -> str:
        return f"<torchembed rotation for {getattr(self.upstream, '__qualname__', self.upstream)}: {self.rotation.describe()}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._hot and len(args) == 4 and not kwargs:
            out = self._in_place(*args)
            if out is not None:
                return out
        rotation = self.rotation
        if rotation.convention == "qk":
            if len(args) < 4 or _unknown(kwargs, ("unsqueeze_dim", "position_ids")):
                return self.upstream(*args, **kwargs)
            q, k, cos, sin = args[:4]
            unsqueeze = kwargs.get("unsqueeze_dim", 1)
            if self._unsqueeze_index is not None and len(args) > self._unsqueeze_index:
                unsqueeze = args[self._unsqueeze_index]
            out = self.rotate(q, k, cos, sin, unsqueeze)
            return self.upstream(*args, **kwargs) if out is None else out
        # one tensor: x (b, h, s, d) with unsqueeze_dim (default 1), or (b, s, h, d) (GPT-J: no such parameter)
        if len(args) < 3 or _unknown(kwargs, ("unsqueeze_dim",)):
            return self.upstream(*args, **kwargs)
        x, a, b = args[:3]
        cos, sin = (b, a) if rotation.convention == "x_sin_cos" else (a, b)
        unsqueeze = 2
        if self._unsqueeze_index is not None:
            unsqueeze = args[self._unsqueeze_index] if len(args) > self._unsqueeze_index else kwargs.get("unsqueeze_dim", 1)
        out = self.rotate(x, None, cos, sin, unsqueeze)
        return self.upstream(*args, **kwargs) if out is None else out[0]

    def _in_place(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor] | None:
        """Inference on the kernel: rotate upstream's fresh q/k projections in place (upstream binds
        its names to the results), one lookup and one launch per layer; None where this does not
        apply (gradients, compiling, another layout or device)."""
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
            return None
        views = self._views
        if views is None or views[0] is not cos or views[1] is not sin:
            if cos.dim() != 3 or sin.shape != cos.shape:
                return None
            half = cos.shape[-1] // 2
            views = self._views = (cos, sin, cos[..., :half], sin[..., :half])
        c, s = views[2], views[3]
        if (q.dim() != 4 or k.dim() != 4 or q.shape[-1] != 2 * c.shape[-1] or k.shape[-1] != q.shape[-1]
                or c.shape[1] != q.shape[2] or c.shape[0] not in (1, q.shape[0]) or k.shape[0] != q.shape[0]
                or k.shape[2] != q.shape[2] or q.stride(-1) != 1 or k.stride(-1) != 1 or 0 in q.stride()
                or 0 in k.stride() or not kernels.kernel_can_run(q)):
            return None
        return kernels.rotary_tables_(q, k, c, s)

    def rotate(self, q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor | None] | None:
        """The rotation out of place, or None where upstream should run instead."""
        rotation = self.rotation
        if cos.dim() != 3 or q.dim() != 4 or unsqueeze_dim not in (1, 2) or sin.shape != cos.shape:
            return None
        rot = rotation.rotary_dim(cos.shape[-1])
        if q.shape[-1] != rot and not (rotation.partial and q.shape[-1] > rot):
            return None
        seq_dim = 2 if unsqueeze_dim == 1 else 1  # the tables' (b, s) against q's batch and sequence dims
        if cos.shape[1] != q.shape[seq_dim] or cos.shape[0] not in (1, q.shape[0]):
            return None
        if unsqueeze_dim == 2:  # (b, s, h, d): rotate the (b, h, s, d) view
            q_out, k_out = self.rotate(q.transpose(1, 2), None if k is None else k.transpose(1, 2), cos, sin, 1)
            return q_out.transpose(1, 2), None if k_out is None else k_out.transpose(1, 2)
        if rotation.trailing and q.shape[-1] > rot:  # rotate the last rot features, pass the leading ones
            q_out, k_out = self.rotate(q[..., -rot:], None if k is None else k[..., -rot:], cos, sin, 1)
            return (torch.cat((q[..., :-rot], q_out), dim=-1),
                    None if k is None else torch.cat((k[..., :-rot], k_out), dim=-1))
        c, s = rotation.half_tables(cos, sin)
        pairing = rotation.pairing
        if pairing == "deinterleave":  # reorder once (a copy), then rotate half-split
            q = torch.cat((_deinterleave(q[..., :rot]), q[..., rot:]), dim=-1)
            k = None if k is None else torch.cat((_deinterleave(k[..., :rot]), k[..., rot:]), dim=-1)
            pairing = "half"
        interleaved, conjugate = pairing == "interleaved", rotation.conjugate
        if self.fused is not False and kernels.kernel_can_run(q):
            if k is None:
                return kernels.rotary_fused(q, q[:, :0], c, s, interleaved=interleaved, conjugate=conjugate)[0], None
            return kernels.rotary_fused(q, k, c, s, interleaved=interleaved, conjugate=conjugate)
        c, s = c.unsqueeze(1), s.unsqueeze(1)  # (b, 1, s, r/2): broadcast over heads
        rotated = (None if x is None else apply_rotary(x, c, s, interleaved=interleaved, conjugate=conjugate) for x in (q, k))
        return tuple(rotated)  # type: ignore[return-value]
