"""torchembed's replacement for an upstream rotation helper: the same call, the one rotation.

A :class:`RotaryHelper` call is bound to upstream's signature with the defaults recognition read
(:mod:`torchembed.patches.binding`), takes its tables where the rotation's table source says, asks the route once
whether it runs on the kernel (:func:`torchembed.kernels.route.use_rope_kernel`) and derives what its tensors are
rotated with once per forward (:func:`torchembed.kernels.per_forward.derive`: every layer gets the same tables). Then it
goes down once: to the kernel (:func:`torchembed.kernels.rotary_fused`) or to
:func:`torchembed.functional.apply_rotary`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchembed import kernels
from torchembed.functional.rope import apply_rotary
from torchembed.kernels.per_forward import current, derive
from torchembed.kernels.route import refuse, use_rope_kernel
from torchembed.patches.binding import CallSignature
from torchembed.patches.rope.recognition import (
    UNSQUEEZE_DIM, Rotation, broadcast_table, deinterleave, merge_mrope, upstream_function,
)

__all__ = ["RotaryHelper"]


class _Group(NamedTuple):
    """Tensors of one call rotated by the same tables, in the form their path reads them."""

    members: tuple[int, ...]  # their places among the call's given tensors
    cos: Tensor
    sin: Tensor
    full: bool  # the tables hold each rotated feature's own entry (upstream's rows), else one per pair
    kernel: str | None  # how the kernel views the tensors (:func:`_to_bhsd`); None: the PyTorch rotation


class _Plan(NamedTuple):
    """How one call's tensors are rotated: derived from its tables and its tensors' shapes and dtypes, once per
    forward (:meth:`RotaryHelper._plan`)."""

    groups: tuple[_Group, ...]
    rot: int  # the rotated features (per section)
    lead: int = 0  # leading tokens that pass through (DINOv3's cls and registers)
    at: int = -2  # the tokens' axis
    sections: int = 0  # feature sections rotated apart (multidimensional RoPE)


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
        call = rotation.call
        self._signature = CallSignature(self.__name__, call.params, dict(call.defaults), call.keywords)

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
        kernel = None
        if self.rotation.usual and len(args) == 4 and not kwargs and args[0].shape[-1] == args[2].shape[-1]:
            # HF's usual call, with less Python around it: on the kernel in place at inference (one cache lookup and
            # one launch per layer), else the PyTorch rotation with upstream's own tables
            q, k, cos, sin = args
            kernel = use_rope_kernel(self.fused, q)  # (decided once for the call)
            if not kernel:
                compute = torch.float64 if q.dtype == torch.float64 else torch.float32
                rule = self.rotation.shape.broadcast
                c, s = derive(current(), (cos, sin), ("usual", rule, compute), _usual_tables, cos, sin, rule, compute)
                return apply_rotary(q, c, s, full=True), apply_rotary(k, c, s, full=True)
            out = kernels.rotary_fused_usual(q, k, cos, sin)
            if out is not None:
                return out  # (None: a call the kernel does not take, told before any launch: the general way)
        return self._serve(self._signature.bind(args, kwargs), kernel)

    def _serve(self, values: dict[str, Any], kernel: bool | None) -> Any:
        """One bound call: its tensors and its tables' source gathered, the route asked where the caller has not
        (``kernel``), the call's :class:`_Plan` derived once per forward, then rotated (:meth:`_rotate`)."""
        rotation = self.rotation
        source, shape = rotation.source, rotation.shape
        xs = [values[name] for name in rotation.call.rotated]
        given = [x for x in xs if x is not None]
        tables = tuple(values[name] for name in rotation.call.tables)
        how = values[source.param] if source.param else None  # M-RoPE sections, position ids, per-section ids
        u = values.get(UNSQUEEZE_DIM, shape.unsqueeze_default) if shape.broadcast == "param" else None
        if kernel is None:
            kernel = bool(given) and source.kind != "sections" and use_rope_kernel(self.fused, given[0])
        sources = (*tables, how) if source.kind == "indexed" else tables  # (the ids that index the tables too)
        scope, tag = current(), None
        if scope is not None:  # all that the plan reads besides its sources (a traced graph derives it afresh)
            extra = tuple(how) if source.kind == "mrope" else how.shape[-1] if source.kind == "sections" else None
            tag = (id(self), kernel, u, extra, tuple((x.shape, x.dtype) for x in given))
        plan = derive(scope, sources, tag, self._plan, tables, how, given, u, kernel)
        return self._rotate(plan, xs, given)

    def _plan(self, tables: tuple[Tensor, ...], how: Any, given: list[Tensor], u: int | None, kernel: bool) -> _Plan:
        """How tensors shaped as ``given`` (their shapes and dtypes are all it reads of them) are rotated by
        ``tables`` taken from the table source (``how``: its argument), ``u``: the call's unsqueeze_dim, ``kernel``:
        the route's decision.

        Raises:
            ValueError: a tensor narrower than the rotated features, or wider for a helper that rotates them all;
                features that do not split into the sections.
            FusedUnavailableError: ``fused=True`` where the kernel cannot take the call.
        """
        rotation = self.rotation
        math, shape, kind = rotation.math, rotation.shape, rotation.source.kind
        first, second = tables if len(tables) == 2 else (tables[0], None)
        if kind == "sections":
            return self._sections(given[0], first, second, how.shape[-1], shape.unsqueeze_default if u is None else u)
        if kind == "mrope":  # (3, ..., w): one position axis per feature section
            first, second = merge_mrope(first, how), merge_mrope(second, how)
        elif kind == "indexed":  # (T, w) tables of every position: this call's rows
            first, second = first[how], second[how]
        c, s = rotation.half_tables(first, second)
        if math.layout == "complex":  # views of every other float: copied once
            c, s = c.contiguous(), s.contiguous()
        full = _own_tables(rotation, first, second)
        rule = _unsqueezed_rule(u, c.dim()) if shape.broadcast == "param" else shape.rule_for(given[0], c)
        at = -2 if rule == "hs" else -3  # the tokens' axis (tail, prefix)
        shapes, first_tokens, everyone = [x.shape for x in given], given[0].shape[at], tuple(range(len(given)))
        lead, parts = 0, [(everyone, c, s, full)]
        if shape.prefix and first_tokens > c.shape[-2]:  # the leading tokens pass through
            lead = first_tokens - c.shape[-2]
            shapes = [(*x[:at], x[at] - lead, *x[at:][1:]) for x in shapes]
        elif shape.tail and len(given) > 1 and first_tokens < c.shape[-2]:  # the first tensor: the tables' last rows
            last = (..., slice(c.shape[-2] - first_tokens, None), slice(None))
            parts = [((0,), c[last], s[last], full and (full[0][last], full[1][last])), (everyone[1:], c, s, full)]
        groups = tuple(self._group(members, [shapes[i] for i in members], given[members[0]], c, s, full, u, kernel)
                       for members, c, s, full in parts)
        return _Plan(groups, 2 * c.shape[-1], lead, at)

    def _group(self, members: tuple[int, ...], shapes: list[Sequence[int]], x: Tensor, c: Tensor, s: Tensor,
               full: tuple[Tensor, Tensor] | None, u: int | None, kernel: bool) -> _Group:
        """Tensors of ``shapes`` (the first like ``x`` in rank and dtype) rotated by half tables ``c``/``s``
        ``(..., s, r/2)`` (``full``: :func:`_own_tables`): the kernel's tables where ``kernel`` and the layout allow,
        else the PyTorch rotation's, broadcast as the helper broadcasts them and in its compute dtype."""
        rotation = self.rotation
        math = rotation.math
        rot = 2 * c.shape[-1]
        for width in (x[-1] for x in shapes):
            if width < rot or (width > rot and not math.partial):
                raise ValueError(f"{self.__name__}: a tensor of {width} features for tables of {rot} rotated features "
                                 f"(upstream {rotation.describe()})")
        if math.trailing:  # the last rot features rotate
            shapes = [(*x[:-1], rot) for x in shapes]
        rule = "param" if rotation.shape.broadcast == "param" else rotation.shape.rule_for(x, c)
        if rule != "param":  # tables as (n, S, r/2) rows, whatever singleton axes they carry
            c, s = _rows(c, shapes[0], rule), _rows(s, shapes[0], rule)
            full = None if full is None else (_rows(full[0], shapes[0], rule), _rows(full[1], shapes[0], rule))
        kernel_rule = _kernel_rule(rule, u, c, len(shapes[0]))
        if kernel and _kernel_fits(shapes, c.shape, kernel_rule):
            halves = full is not None and math.pairing != "interleaved"  # a pair's second feature its own entries
            cb, sb = (t if t.dim() == 3 else t[None] for t in (full if halves else (c, s)))
            return _Group(members, cb, sb, halves, kernel_rule)
        if self.fused:
            raise refuse(f"the fused RoPE kernel ({self.__name__})", f"it was called with tensors of shapes "
                         f"{[tuple(x) for x in shapes]} and tables {tuple(c.shape)}, a layout it does not take")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        cb, sb = (broadcast_table(t, rule, u).to(compute) for t in (full if full is not None else (c, s)))
        return _Group(members, cb, sb, full is not None, None)

    def _sections(self, x: Tensor, first: Tensor, second: Tensor, sections: int, unsqueeze: int) -> _Plan:
        """Multidimensional RoPE: ``x (..., d)`` as ``sections`` equal feature sections, each rotated half-split by its
        slice of the tables (PyTorch operations; the kernel takes one table per token, and a patch with ``fused=True``
        refuses these helpers: ``rope/families.py``)."""
        width = 2 * (x.shape[-1] // (2 * sections)) if sections > 0 else 0
        if width == 0 or width * sections != x.shape[-1]:
            raise ValueError(f"{self.__name__}: {x.shape[-1]} features do not split into {sections} rotated sections")
        cos, sin = (first, second) if self.rotation.call.tables[0] == "cos" else (second, first)
        at = unsqueeze if unsqueeze >= 0 else unsqueeze - 1  # the sections' axis comes last
        c, s = (t.unflatten(-1, (sections, width))[..., : width // 2].unsqueeze(at) for t in (cos, sin))
        return _Plan((_Group((0,), c, s, False, None),), width, sections=sections)

    def _rotate(self, plan: _Plan, xs: list[Tensor | None], given: list[Tensor]) -> Any:
        """The call's tensors rotated as ``plan`` says, on the kernel (two tensors per launch where they pair up, else
        one with an empty second) or with :func:`torchembed.functional.apply_rotary`, returned as upstream returns
        them."""
        math = self.rotation.math
        rot, lead, at = plan.rot, plan.lead, plan.at
        interleaved = math.pairing == "interleaved"
        rotated: list[Tensor] = [*given]
        for group in plan.groups:
            ts = [given[i] for i in group.members]
            if lead:  # the leading tokens pass through
                passed, ts = zip(*(x.split((lead, x.shape[at] - lead), dim=at) for x in ts))
            if math.trailing:  # the last rot features rotate, the leading ones pass through
                heads, ts = [x[..., :-rot] for x in ts], [x[..., -rot:] for x in ts]
            if math.pairing == "deinterleave":  # reordered once (a copy), then rotated half-split
                ts = [torch.cat((deinterleave(x[..., :rot]), x[..., rot:]), dim=-1) for x in ts]
            if plan.sections:
                ts = [x.unflatten(-1, (plan.sections, rot)) for x in ts]
            if group.kernel is not None:
                views, outs, i = [_to_bhsd(x, group.kernel) for x in ts], [], 0
                while i < len(views):
                    pair = i + 1 < len(views) and _pairable(views[i], views[i + 1])
                    out = kernels.rotary_fused(views[i], views[i + 1] if pair else views[i][:, :0], group.cos,
                                               group.sin, interleaved=interleaved, conjugate=math.conjugate,
                                               halves=group.full)
                    outs += out if pair else out[:1]
                    i += 2 if pair else 1
                outs = [_from_bhsd(o, x, group.kernel) for x, o in zip(ts, outs)]
            else:
                outs = [apply_rotary(x, group.cos, group.sin, interleaved=interleaved, conjugate=math.conjugate,
                                     full=group.full) for x in ts]
            if plan.sections:
                outs = [o.flatten(-2) for o in outs]
            if math.trailing:
                outs = [torch.cat((h, o), dim=-1) for h, o in zip(heads, outs)]
            if lead:
                outs = [torch.cat((p, o), dim=at) for p, o in zip(passed, outs)]
            for i, o in zip(group.members, outs):
                rotated[i] = o
        out = iter(rotated)
        result = tuple(None if x is None else next(out) for x in xs)
        return result[0] if self.rotation.call.single and len(given) == 1 else result


def _usual_tables(cos: Tensor, sin: Tensor, rule: str, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """HF's own ``(cos, sin)`` broadcast as its usual helper does and in the rotation's compute dtype."""
    return broadcast_table(cos, rule, 1).to(compute), broadcast_table(sin, rule, 1).to(compute)


def _own_tables(rotation: Rotation, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """The helper's own ``(cos, sin)`` where it multiplies each feature by its own entry (``cat`` tables with
    half-split pairing, ``repeat`` tables with interleaved pairing), else None. The PyTorch path multiplies by them
    as upstream does, so it computes upstream's function also where a feature pair's two entries differ
    (HunYuan-VL's M-RoPE sections span both halves of the head: at an image token they are two axes' angles)."""
    layout, pairing = rotation.math.layout, rotation.math.pairing
    if not ((layout == "cat" and pairing in ("half", "deinterleave")) or (layout == "repeat" and pairing == "interleaved")):
        return None  # (other pairings of these layouts rearrange the tables inside the helper)
    return (first, second) if rotation.call.tables[0] == "cos" else (second, first)


def _rows(table: Tensor, x: Sequence[int], rule: str) -> Tensor:
    """A fixed-rule helper's half table as ``(n, S, r/2)`` rows, ``n`` 1 or the batch of an ``x`` of this shape
    (``(S, r/2)`` for an unbatched x): what it holds, whatever singleton axes it carries (Llama 4's vision tower hands
    ``(S, 1, r/2)`` frequencies, which its helper views against the queries). Unchanged where its size does not fit."""
    seq_axis = -3 if rule == "sh" else -2
    lead = x[:-3] if rule in ("hs", "sh") else x[:-2]
    if len(x) < -seq_axis or len(lead) > 1:
        return table
    seq, width = x[seq_axis], table.shape[-1]
    n, rest = divmod(table.numel(), seq * width) if seq * width else (0, 1)
    if rest or not (n == 1 or (lead and n == lead[0])):
        return table
    shape = (n, seq, width) if lead else (seq, width)
    return table if table.shape == shape else table.reshape(shape)


def _kernel_rule(rule: str, unsqueeze: Any, table: Tensor, x_dim: int) -> str | None:
    """How the kernel reads the tables of a call broadcast by ``rule`` (the helper's probed rule, "param" for one
    taking unsqueeze_dim) against tensors of ``x_dim`` dimensions: "hs" (tokens second to last), "sh", "flat"
    (``(b, s, d)``, one head), or None where it cannot. Right-aligned ``(1 or none, S, r/2)`` tables against a 4-D
    ``x`` (SAM 3's "flat" rule) are per-token rows: "hs"."""
    if rule == "param":
        return _unsqueezed_rule(unsqueeze, table.dim())
    if rule == "flat" and x_dim == 4 and (table.dim() == 2 or (table.dim() == 3 and table.shape[0] == 1)):
        return "hs"
    return rule


def _unsqueezed_rule(unsqueeze: Any, table_dim: int) -> str | None:
    """Where HF's ``cos.unsqueeze(unsqueeze_dim)`` puts the tables' token axis against ``x``: "hs" for ``(S, R)``
    tables at 0 or ``(B, S, R)`` at 1 (tokens second to last, ``x (B, H, S, D)``), "sh" for ``(S, R)`` at 1 or
    ``(B, S, R)`` at 2 (``x (B, S, H, D)``); None for any other broadcast."""
    if type(unsqueeze) is not int:
        return None
    return {(2, 0): "hs", (2, 1): "sh", (3, 1): "hs", (3, 2): "sh"}.get((table_dim, unsqueeze % (table_dim + 1)))


def _kernel_fits(shapes: list[Sequence[int]], table: Sequence[int], rule: str | None) -> bool:
    """Whether the kernel takes tensors of ``shapes`` as ``(B, H, S, D)`` views (:func:`_to_bhsd`) with
    ``(B or 1, S, R/2)`` views of tables of shape ``table`` (``rule``: :func:`_kernel_rule`)."""
    nd = len(shapes[0])
    if rule == "flat":  # (b, s, d): one head
        if nd != 3 or len(table) != 3 or any(len(x) != 3 for x in shapes):
            return False
        shapes, nd, rule = [(x[0], 1, *x[1:]) for x in shapes], 4, "hs"
    if rule is None or any(len(x) != nd for x in shapes) or len(table) not in (nd - 1, nd - 2) or not 3 <= nd <= 4:
        return False
    seq = shapes[0][-2 if rule == "hs" else -3]
    if table[-2] != seq or (len(table) == 3 and table[0] not in (1, shapes[0][0])) or (nd == 3 and len(table) != 2):
        return False
    # (a feature stride other than 1 costs rotary_fused one copy)
    return all(x[-2 if rule == "hs" else -3] == seq for x in shapes)


def _to_bhsd(x: Tensor, rule: str) -> Tensor:
    """``x`` as the kernel's ``(B, H, S, D)`` view (a layout :func:`_kernel_fits` takes)."""
    if rule == "flat":  # (b, s, d): one head
        return x.unsqueeze(1)
    if rule == "hs":
        return x if x.dim() == 4 else x[None]
    return x.transpose(-3, -2) if x.dim() == 4 else x.transpose(0, 1)[None]


def _from_bhsd(o: Tensor, x: Tensor, rule: str) -> Tensor:
    """The kernel's output ``o`` for :func:`_to_bhsd` of ``x``, in ``x``'s layout (the inverse view)."""
    if rule == "flat":
        return o[:, 0]
    if rule == "hs":
        return o if x.dim() == 4 else o[0]
    return o.transpose(-3, -2) if x.dim() == 4 else o[0].transpose(0, 1)


def _pairable(q: Tensor, k: Tensor) -> bool:
    """q and k the kernel rotates in one launch: one dtype, the same batch, tokens and features."""
    return q.dtype == k.dtype and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]


def _restore(rotation: Rotation, module: str, qualname: str, fused: bool | None) -> RotaryHelper:
    """The :class:`RotaryHelper` of an upstream helper given by name (how one is unpickled)."""
    upstream: Any = importlib.import_module(module)
    for part in qualname.split("."):
        upstream = getattr(upstream, part)
    return RotaryHelper.get(rotation, upstream_function(upstream), fused)
