"""torchembed's replacement for an upstream rotation helper: the same call, the one rotation.

:class:`RotaryHelper` takes the place of one recognised helper (:mod:`torchembed.patches.rope.recognition`): its calls are
bound to upstream's signature (:mod:`torchembed.patches.binding`), the tables reduced to what the rotation reads, and
the tensors handed to the kernel or to the one PyTorch rotation as :func:`torchembed.kernels.route.use_rope_kernel`
decides (asked once per call) (:func:`torchembed.kernels.rotary_fused`, :func:`torchembed.functional.apply_rotary`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchembed import functional, kernels
from torchembed.functional.rope import apply_rotary
from torchembed.kernels.per_forward import current, derive
from torchembed.kernels.route import refuse, use_rope_kernel
from torchembed.patches.binding import CallSignature
from torchembed.patches.rope.recognition import (
    UNSQUEEZE_DIM, Rotation, broadcast_table, deinterleave, merge_mrope, parameter_defaults, upstream_function,
)

__all__ = ["RotaryHelper"]


class RotaryHelper:
    """torchembed's drop-in for one upstream rotation helper: the same parameters, the same results.

    Called as upstream is (positional or keyword arguments, optional tensors left out); rotates in float32 and rounds
    once: with :func:`torchembed.kernels.rotary_fused` (q and k in one launch; at inference HF's usual
    ``helper(q, k, cos, sin)`` rotates in place: upstream binds its names to the returned tensors, which are they) where
    :func:`~torchembed.kernels.route.use_rope_kernel` says so, with :func:`torchembed.functional.apply_rotary` elsewhere
    (upstream's products and sum in float32, rounded once). Upstream's helper is never called.

    One instance per (rotation, upstream, fused) (:meth:`get`), so the rebound attention code is shared by every model
    patched the same way; it pickles as those three.
    """

    _INSTANCES: dict[tuple, "RotaryHelper"] = {}

    def __init__(self, rotation: Rotation, upstream: Callable, fused: bool | None) -> None:
        self.rotation, self.upstream, self.fused = rotation, upstream, fused
        self.__name__ = self.__qualname__ = f"torchembed_{getattr(upstream, '__name__', 'rotary')}"
        self._signature = CallSignature(self.__name__, rotation.params, parameter_defaults(upstream), rotation.keywords)
    @classmethod
    def get(cls, rotation: Rotation, upstream: Callable, fused: bool | None) -> "RotaryHelper":
        key = (rotation, id(upstream), fused)
        helper = cls._INSTANCES.get(key)
        if helper is None or helper.upstream is not upstream:
            helper = cls._INSTANCES[key] = cls(rotation, upstream, fused)
        return helper

    def __reduce__(self) -> tuple:
        # upstream by name: the module-level object may be a hub-kernel wrapper around it (not picklable)
        return (_restore, (self.rotation, self.upstream.__module__, self.upstream.__qualname__, self.fused))

    def __repr__(self) -> str:
        return f"<torchembed rotation for {getattr(self.upstream, '__qualname__', self.upstream)}: {self.rotation.describe()}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.rotation.usual and len(args) == 4 and not kwargs:
            kernel = use_rope_kernel(self.fused, args[0])  # (decided once for the call)
            out = self._usual_call(*args, kernel)
            if out is not None:
                return out
            return self._serve(self._signature.bind(args, kwargs), kernel)
        return self._serve(self._signature.bind(args, kwargs))

    def _serve(self, values: dict[str, Any], kernel: bool | None = None) -> Any:
        """The rotation of one bound call, returned as upstream returns it; ``kernel``: the call's decision, asked here
        where the caller has not asked it."""
        rotation = self.rotation
        first, second = (values[name] for name in rotation.tables) if len(rotation.tables) == 2 else (values[rotation.tables[0]], None)
        if rotation.mrope:
            first, second = self._merged(first, second, values[rotation.mrope])
        elif rotation.indexed:  # (T, w) tables of every position: this call's rows
            ids = values[rotation.indexed]
            first, second = first[ids], second[ids]
        c, s = self._half(first, second)
        full = self._own_tables(first, second)
        u = values.get(UNSQUEEZE_DIM, rotation.unsqueeze_default) if rotation.broadcast == "param" else None
        xs = [values[name] for name in rotation.rotated]
        if rotation.sections:
            return self._rotate_sections(xs[0], first, second, values[rotation.sections].shape[-1],
                                         rotation.unsqueeze_default if u is None else u)
        given = [x for x in xs if x is not None]
        if kernel is None:
            kernel = bool(given) and use_rope_kernel(self.fused, given[0])
        rule = _unsqueezed_rule(u, c.dim()) if rotation.broadcast == "param" else rotation.rule_for(given[0], c) if given else ""
        at = -2 if rule == "hs" else -3  # the tokens' axis (tail, prefix)
        first = given[0].shape[at] if given else 0
        if rotation.prefix and given and first > c.shape[-2]:  # the leading tokens pass through
            lead = first - c.shape[-2]
            parts = [x.split((lead, x.shape[at] - lead), dim=at) for x in given]
            rotated = iter(torch.cat((p, r), dim=at) for p, r in
                           zip((p for p, _ in parts), self.rotate([r for _, r in parts], c, s, u, full, kernel)))
        elif rotation.tail and len(given) > 1 and first < c.shape[-2]:  # the first tensor: the tables' last rows
            last = (lambda t: t[..., -first:, :]) if first else (lambda t: t[..., :0, :])
            rotated = iter(self.rotate(given[:1], last(c), last(s), u, full and (last(full[0]), last(full[1])), kernel)
                           + self.rotate(given[1:], c, s, u, full, kernel))
        else:
            rotated = iter(self.rotate(given, c, s, u, full, kernel))
        out = tuple(None if x is None else next(rotated) for x in xs)
        return out[0] if rotation.single and len(given) == 1 else out

    def _merged(self, first: Tensor, second: Tensor, sections: Any) -> tuple[Tensor, Tensor]:
        """M-RoPE tables merged (:func:`merge_mrope`), once per forward."""
        return derive(current(), (first, second), (id(self), "mrope", tuple(sections)),
                      lambda: (merge_mrope(first, sections), merge_mrope(second, sections)))

    def _rotate_sections(self, x: Tensor, first: Tensor, second: Tensor, sections: int, unsqueeze: int) -> Tensor:
        """Multidimensional RoPE: ``x (..., d)`` as ``sections`` equal feature sections, each rotated half-split by its
        slice of the tables (PyTorch operations; the kernel takes one table per token, and a patch with ``fused=True``
        refuses these helpers: ``rope/families.py``)."""
        width = 2 * (x.shape[-1] // (2 * sections)) if sections > 0 else 0
        if width == 0 or width * sections != x.shape[-1]:
            raise ValueError(f"{self.__name__}: {x.shape[-1]} features do not split into {sections} rotated sections")
        cos, sin = (first, second) if self.rotation.tables[0] == "cos" else (second, first)
        at = unsqueeze if unsqueeze >= 0 else unsqueeze - 1  # the sections' axis comes last
        c, s = (t.unflatten(-1, (sections, width))[..., : width // 2].unsqueeze(at) for t in (cos, sin))
        return apply_rotary(x.unflatten(-1, (sections, width)), c, s).flatten(-2)

    def _half(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor]:
        """The half tables of ``(first, second)``, once per forward (every layer gets the same tables)."""
        def make() -> tuple[Tensor, Tensor]:
            c, s = self.rotation.half_tables(first, second)
            if self.rotation.layout == "complex":  # views of every other float: copied once per forward
                c, s = c.contiguous(), s.contiguous()
            return c, s

        return derive(current(), (first, second), (id(self), "half"), make)

    def _own_tables(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The helper's own ``(cos, sin)`` where it multiplies each feature by its own entry (``cat`` tables with
        half-split pairing, ``repeat`` tables with interleaved pairing), else None. The PyTorch path multiplies by them
        as upstream does, so it computes upstream's function also where a feature pair's two entries differ
        (HunYuan-VL's M-RoPE sections span both halves of the head: at an image token they are two axes' angles)."""
        rotation = self.rotation
        if not ((rotation.layout == "cat" and rotation.pairing in ("half", "deinterleave"))
                or (rotation.layout == "repeat" and rotation.pairing == "interleaved")):
            return None  # (other pairings of these layouts rearrange the tables inside the helper)
        return (first, second) if self.rotation.tables[0] == "cos" else (second, first)

    def rotate(self, xs: list[Tensor], c: Tensor, s: Tensor, unsqueeze: int | None,
               full: tuple[Tensor, Tensor] | None = None, kernel: bool = False) -> list[Tensor]:
        """``xs`` rotated by half tables ``c``/``s`` ``(..., s, r/2)`` (broadcast as the helper does, ``unsqueeze``:
        its unsqueeze_dim argument; ``full``: :meth:`_own_tables`): on the kernel (one launch for two tensors) where
        ``kernel`` (the call's decision) and the layout allows, else in PyTorch.

        Raises:
            ValueError: a tensor narrower than the rotated features, or wider for a helper that rotates them all.
            FusedUnavailableError: ``fused=True`` where the kernel cannot take the call.
        """
        rotation = self.rotation
        rot = 2 * c.shape[-1]
        for x in xs:
            width = x.shape[-1]
            if width < rot or (width > rot and not rotation.partial):
                raise ValueError(f"{self.__name__}: a tensor of {width} features for tables of {rot} rotated features "
                                 f"(upstream {rotation.describe()})")
        if rotation.trailing:  # rotate the last rot features, the leading ones pass through
            tails = self._rotate_leading([x[..., -rot:] for x in xs], c, s, unsqueeze, full, kernel)
            return [torch.cat((x[..., :-rot], tail), dim=-1) for x, tail in zip(xs, tails)]
        return self._rotate_leading(xs, c, s, unsqueeze, full, kernel)

    def _rotate_leading(self, xs: list[Tensor], c: Tensor, s: Tensor, unsqueeze: int | None,
                        full: tuple[Tensor, Tensor] | None, kernel: bool) -> list[Tensor]:
        rotation = self.rotation
        rot = 2 * c.shape[-1]
        pairing = rotation.pairing
        if pairing == "deinterleave":  # reorder once (a copy), then rotate half-split
            xs = [torch.cat((deinterleave(x[..., :rot]), x[..., rot:]), dim=-1) for x in xs]
            pairing = "half"
        interleaved = pairing == "interleaved"
        rule = "param" if rotation.broadcast == "param" else rotation.rule_for(xs[0], c)
        if rule != "param":  # tables as (n, S, r/2) rows, whatever singleton axes they carry
            c, s = _rows(c, xs[0], rule), _rows(s, xs[0], rule)
            full = None if full is None else (_rows(full[0], xs[0], rule), _rows(full[1], xs[0], rule))
        kernel_rule = _kernel_rule(rule, unsqueeze, c, xs[0])
        views = self._kernel_views(xs, c, kernel_rule) if kernel else None
        if views is None and self.fused:
            raise refuse(f"the fused RoPE kernel ({self.__name__})", f"it was called with tensors of shapes "
                         f"{[tuple(x.shape) for x in xs]} and tables {tuple(c.shape)}, a layout it does not take")
        if views is not None:
            bhsd, tables_view = views
            halves = full is not None and not interleaved  # the helper's own rows: a pair's second feature its entries
            cb, sb = (tables_view(t) for t in (full if halves else (c, s)))
            outs, i = [], 0
            while i < len(bhsd):  # two tensors per launch where they pair up, else one (an empty second)
                pair = i + 1 < len(bhsd) and _pairable(bhsd[i], bhsd[i + 1])
                out = kernels.rotary_fused(bhsd[i], bhsd[i + 1] if pair else bhsd[i][:, :0], cb, sb,
                                           interleaved=interleaved, conjugate=rotation.conjugate, halves=halves)
                outs += out if pair else out[:1]
                i += 2 if pair else 1
            return [_back(x, kernel_rule)(o) for x, o in zip(xs, outs)]
        return self._arithmetic(xs, c, s, full, unsqueeze, interleaved, rule)

    def _arithmetic(self, xs: list[Tensor], c: Tensor, s: Tensor, full: tuple[Tensor, Tensor] | None,
                    unsqueeze: int | None, interleaved: bool, rule: str) -> list[Tensor]:
        """The PyTorch path: :func:`torchembed.functional.apply_rotary` on each tensor, with the helper's own full-width
        tables where it has them (``full``: each feature its own entry, as upstream multiplies), else the half tables,
        broadcast as the helper broadcasts them."""
        cb, sb = self._prepared(full if full is not None else (c, s), rule, unsqueeze, xs[0].dtype)
        return [functional.apply_rotary(x, cb, sb, interleaved=interleaved, conjugate=self.rotation.conjugate,
                                        full=full is not None) for x in xs]

    def _prepared(self, tables: tuple[Tensor, Tensor], rule: str, unsqueeze: int | None,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``tables`` broadcast as the helper does and in the rotation's compute dtype (float32, or float64 for float64
        inputs), once per forward (every layer of a forward gets the same ones), not once per tensor."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return derive(current(), tables, ("prep", rule, unsqueeze, compute),
                      lambda: tuple(broadcast_table(t, rule, unsqueeze).to(compute) for t in tables))

    def _kernel_views(self, xs: list[Tensor], c: Tensor, rule: str | None):
        """``xs`` as the kernel's ``(B, H, S, D)`` views and a function making ``(B or 1, S, R/2)`` tables of the half
        tables; None for layouts the kernel does not take."""
        nd = xs[0].dim()
        if rule == "flat":  # (b, s, d): one head
            if nd != 3 or c.dim() != 3 or any(x.dim() != 3 for x in xs):
                return None
            xs, nd, rule = [x.unsqueeze(1) for x in xs], 4, "hs"
        if rule is None or any(x.dim() != nd for x in xs) or c.dim() not in (nd - 1, nd - 2) or not 3 <= nd <= 4:
            return None
        seq = xs[0].shape[-2 if rule == "hs" else -3]
        if c.shape[-2] != seq or (c.dim() == 3 and c.shape[0] not in (1, xs[0].shape[0])) or (nd == 3 and c.dim() != 2):
            return None
        if rule == "hs":
            bhsd = [x if nd == 4 else x[None] for x in xs]
        else:
            bhsd = [x.transpose(-3, -2) if nd == 4 else x.transpose(0, 1)[None] for x in xs]
        if any(x.shape[-2] != seq for x in bhsd):  # (a feature stride other than 1 costs rotary_fused one copy)
            return None
        return bhsd, (lambda t: t if t.dim() == 3 else t[None])

    def _usual_call(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, kernel: bool) -> tuple[Tensor, Tensor] | None:
        """HF's usual call, with less Python around it: on the kernel at inference in place (one cache lookup and one
        launch per layer), else :func:`torchembed.functional.apply_rotary` with upstream's own tables. None: the general
        way (also a call the kernel does not take, which :func:`~torchembed.kernels.rope.rotary_fused_usual` tells
        before any launch)."""
        if q.shape[-1] != cos.shape[-1]:
            return None
        if kernel:
            return kernels.rotary_fused_usual(q, k, cos, sin)
        cb, sb = self._prepared((cos, sin), self.rotation.broadcast, 1, q.dtype)
        return functional.apply_rotary(q, cb, sb, full=True), functional.apply_rotary(k, cb, sb, full=True)


def _rows(table: Tensor, x: Tensor, rule: str) -> Tensor:
    """A fixed-rule helper's half table as ``(n, S, r/2)`` rows, ``n`` 1 or x's batch (``(S, r/2)`` for an unbatched
    x): what it holds, whatever singleton axes it carries (Llama 4's vision tower hands ``(S, 1, r/2)`` frequencies,
    which its helper views against the queries). Unchanged where its size does not fit."""
    seq_axis = -3 if rule == "sh" else -2
    lead = x.shape[:-3] if rule in ("hs", "sh") else x.shape[:-2]
    if x.dim() < -seq_axis or len(lead) > 1:
        return table
    seq, width = x.shape[seq_axis], table.shape[-1]
    n, rest = divmod(table.numel(), seq * width) if seq * width else (0, 1)
    if rest or not (n == 1 or (lead and n == lead[0])):
        return table
    shape = (n, seq, width) if lead else (seq, width)
    return table if table.shape == shape else table.reshape(shape)


def _pairable(q: Tensor, k: Tensor) -> bool:
    """q and k the kernel rotates in one launch: one dtype, the same batch, tokens and features."""
    return q.dtype == k.dtype and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]


def _kernel_rule(rule: str, unsqueeze: Any, table: Tensor, x: Tensor) -> str | None:
    """How the kernel reads the tables of a call broadcast by ``rule`` (the helper's probed rule, "param" for one
    taking unsqueeze_dim): "hs" (tokens second to last in ``x``), "sh", "flat" (``(b, s, d)``, one head), or None where
    it cannot. Right-aligned ``(1 or none, S, r/2)`` tables against a 4-D ``x`` (SAM 3's "flat" rule) are per-token
    rows: "hs"."""
    if rule == "param":
        return _unsqueezed_rule(unsqueeze, table.dim())
    if rule == "flat" and x.dim() == 4 and (table.dim() == 2 or (table.dim() == 3 and table.shape[0] == 1)):
        return "hs"
    return rule


def _unsqueezed_rule(unsqueeze: Any, table_dim: int) -> str | None:
    """Where HF's ``cos.unsqueeze(unsqueeze_dim)`` puts the tables' token axis against ``x``: "hs" for ``(S, R)``
    tables at 0 or ``(B, S, R)`` at 1 (tokens second to last, ``x (B, H, S, D)``), "sh" for ``(S, R)`` at 1 or
    ``(B, S, R)`` at 2 (``x (B, S, H, D)``); None for any other broadcast."""
    if type(unsqueeze) is not int:
        return None
    return {(2, 0): "hs", (2, 1): "sh", (3, 1): "hs", (3, 2): "sh"}.get((table_dim, unsqueeze % (table_dim + 1)))


def _back(x: Tensor, rule: str) -> Callable[[Tensor], Tensor]:
    """The inverse of :meth:`RotaryHelper._kernel_views` for ``x``."""
    nd = x.dim()
    if rule == "flat":
        return lambda o: o[:, 0]
    if rule == "hs":
        return (lambda o: o) if nd == 4 else (lambda o: o[0])
    return (lambda o: o.transpose(-3, -2)) if nd == 4 else (lambda o: o[0].transpose(0, 1))


def _restore(rotation: Rotation, module: str, qualname: str, fused: bool | None) -> RotaryHelper:
    """The :class:`RotaryHelper` of an upstream helper given by name (how one is unpickled)."""
    upstream: Any = importlib.import_module(module)
    for part in qualname.split("."):
        upstream = getattr(upstream, part)
    return RotaryHelper.get(rotation, upstream_function(upstream), fused)
