"""Recognise upstream's rotation helpers by what they compute.

HF attention code rotates queries and keys with a module-level helper (``apply_rotary_pos_emb``, ``apply_rotary_emb``,
``apply_rotary_pos_emb_vision`` ...) fed with tables that the model's rotary module builds. Helpers differ in their
parameters, table layout, feature pairing, and how the tables broadcast against q and k. Instead of a list of names,
torchembed *probes* each candidate helper once (:func:`recognize`): it calls it on random float32 inputs built for
every known way of rotating and keeps the one whose result matches a float64 rotation to 1e-5:

* parameters, by name: the rotated tensors first (``q, k``; ``x``; ``q, k, v`` ...; one whose default is None is
  optional), then the tables: ``cos, sin`` (either order) or one complex ``freqs*`` tensor (``cos + i sin``, Llama 4
  and DeepSeek-V2), then extras that must have defaults: ``unsqueeze_dim`` (the tables are unsqueezed there) and
  ``position_ids`` (only where the probe shows the result does not depend on it);
* broadcast: tables ``(b, s, w)`` or ``(s, w)`` against ``(..., h, s, d)`` (``"hs"``: HF's usual, heads transposed)
  or ``(..., s, h, d)`` (``"sh"``: GPT-J, Llama 4, vision towers), or as ``unsqueeze_dim`` says (``"param"``);
* table layout: ``cat`` (``(θ_0..θ_{r/2-1}, θ_0..θ_{r/2-1})``, LLaMA and most), ``repeat`` (``(θ_0, θ_0, θ_1, ...)``,
  Cohere), ``half`` (``r/2`` entries, GPT-J) or ``complex``;
* pairing: ``half`` ``(x_i, x_{i+r/2})``, ``interleaved`` ``(x_{2i}, x_{2i+1})`` in place, or ``deinterleave``
  (``(x_{2i}, x_{2i+1})`` written in half-split order, DeepSeek-V3); by ``-θ`` where a helper rotates the other way;
  ``partial``: only the leading (or trailing) ``r`` features of a wider input.

What is found, a :class:`Rotation`, is what the replacement (:class:`~torchembed.patches.rope.helper.RotaryHelper`)
does.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from torchembed.functional.rope import apply_rotary

__all__ = ["Call", "Math", "Rotation", "Shape", "TableSource", "UNSQUEEZE_DIM", "broadcast_table", "deinterleave",
           "explain", "recognize", "is_rotation_name", "merge_mrope", "reference_rotate", "upstream_function"]

LAYOUTS = ("cat", "repeat", "half")
PAIRINGS = ("half", "interleaved", "deinterleave")
_TABLE_NAMES = ("cos", "sin")
_ROTATED_LIMIT = 3  # q, k and v at most
UNSQUEEZE_DIM = "unsqueeze_dim"
_POSITION_IDS = "position_ids"
_MROPE = "mrope_section"


def upstream_function(helper: Any) -> Any:
    """The Python function behind a hub-kernel function module, else ``helper`` itself.

    With the ``kernels`` package installed, transformers 5.25 turns module-level helpers such as
    ``apply_rotary_pos_emb`` into ``nn.Module`` instances (``kernels``' ``Func``, class attribute ``kernel_layer_name``)
    whose forward, taking ``*args, **kwargs``, calls the function (or a hub kernel in a kernelized model): what the
    helper computes, and its signature, are the wrapped function's (the one Python function in the forward's closure).
    """
    if isinstance(helper, torch.nn.Module) and "kernel_layer_name" in vars(type(helper)):
        forward = vars(type(helper)).get("forward")
        inner = [cell.cell_contents for cell in getattr(forward, "__closure__", None) or ()
                 if isinstance(getattr(cell, "cell_contents", None), types.FunctionType)]
        if len(inner) == 1:
            return inner[0]
    return helper


def is_rotation_name(name: str) -> bool:
    """A global's name that may be a rotation helper (``apply_rotary_pos_emb``, ``apply_rope`` ...)."""
    lowered = name.lower()
    return ("rotary" in lowered or "rope" in lowered) and not lowered.isupper()


@dataclass(frozen=True)
class Call:
    """How the helper is called, read from its signature once."""

    params: tuple[str, ...]  # its positional-or-keyword parameters
    rotated: tuple[str, ...]  # the tensors it rotates, in order
    tables: tuple[str, ...]  # ("cos", "sin") or ("sin", "cos") in parameter order, or (freqs name,)
    # its parameters' defaults, by name: what a call that leaves one out gets (not compared: a property of the one
    # helper they were read from, whose rotation depends on them only through the fields that are)
    defaults: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    keywords: bool = False  # it takes **kwargs (never given by the attentions: a call with any is refused)
    single: bool = False  # returns a bare tensor when one tensor is rotated (else a tuple, None for left-out ones)


@dataclass(frozen=True)
class Math:
    """What the rotation computes: the tables' layout and the features' pairing."""

    layout: str  # one of LAYOUTS, or "complex"
    pairing: str  # one of PAIRINGS
    partial: bool = False  # rotates the leading r features of a wider input, the rest pass through
    conjugate: bool = False  # rotates by -theta
    trailing: bool = False  # with partial: the last r features rotate, the leading ones pass (DeepSeek-V4)


@dataclass(frozen=True)
class Shape:
    """How the tables broadcast against the rotated tensors."""

    broadcast: str  # "hs" | "sh" | "param"
    unsqueeze_default: int = 1  # with broadcast "param"
    # (rule, rank of x, rank of the tables) of every probe the helper passed: a helper that inserts the
    # heads axis at a fixed place broadcasts (s, w) tables against (s, h, d) as "sh", (b, s, w) as "hs"
    patterns: tuple[tuple[str, int, int], ...] = ()
    tail: bool = False  # a first tensor with fewer tokens than the tables takes their last rows (a drafter's
    # queries over keys that carry the target model's context: Muse Glimmer's assistant)
    prefix: bool = False  # tensors with more tokens than the tables: the leading ones pass (DINOv3's cls and registers)

    def rule_for(self, x: Tensor, table: Tensor) -> str:
        """The broadcast rule of a call with these ranks (the first probed rule where none fits)."""
        ranks = (x.dim(), table.dim())
        return next((rule for rule, *probed in self.patterns if tuple(probed) == ranks), self.broadcast)


SOURCES = ("tables", "sections", "mrope", "indexed")


@dataclass(frozen=True)
class TableSource:
    """Where a call's rows of the tables come from: ``"tables"``, the table arguments as they are; ``"mrope"``, M-RoPE
    tables ``(3, ..., w)`` merged by the sections that ``param`` gives (transformers 4.x); ``"indexed"``, ``(T, w)``
    tables of every position, gathered by the ids that ``param`` gives (older transformers); ``"sections"``, the
    features split into ``param.shape[-1]`` equal sections, each rotated by its slice of the tables (multidimensional
    RoPE)."""

    kind: str = "tables"  # one of SOURCES
    param: str = ""  # the parameter that says how (none for "tables")

    def __post_init__(self) -> None:
        if self.kind not in SOURCES or (self.kind == "tables") == bool(self.param):
            raise ValueError(f"a table source {self.kind!r} with parameter {self.param!r}")


@dataclass(frozen=True)
class Rotation:
    """How an upstream helper rotates, as found by :func:`recognize`: how it is called, what it computes, how its
    tables broadcast and where they come from."""

    call: Call
    math: Math
    shape: Shape
    source: TableSource = TableSource()
    # HF's usual call ``helper(q, k, cos, sin)`` (cat tables, half-split pairing, tokens second to last): the
    # replacement's shortest path (in place on the kernel). Set when made (a plain attribute, read in compiled graphs)
    usual: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        call, math, shape = self.call, self.math, self.shape
        usual = (len(call.rotated) == 2 and call.params[2:4] == ("cos", "sin") and math.layout == "cat"
                 and math.pairing == "half" and not math.conjugate and not math.trailing
                 and shape.broadcast in ("hs", "param") and shape.unsqueeze_default == 1 and not shape.tail
                 and not shape.prefix and self.source.kind == "tables")
        object.__setattr__(self, "usual", usual)

    def half_tables(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor]:
        """The helper's tables (``cos, sin`` or ``freqs``) -> cos and sin of the ``r/2`` angles."""
        layout = self.math.layout
        if layout == "complex":
            pairs = torch.view_as_real(first)
            return pairs[..., 0], pairs[..., 1]
        cos, sin = (first, second) if self.call.tables[0] == "cos" else (second, first)
        if layout == "cat":
            half = cos.shape[-1] // 2
            return cos[..., :half], sin[..., :half]
        if layout == "repeat":
            return cos[..., ::2], sin[..., ::2]
        return cos, sin

    def describe(self) -> str:
        math, shape, source = self.math, self.shape, self.source
        if source.kind == "sections":
            return f"{math.layout} tables, {math.pairing} pairing per feature section ({source.param}.shape[-1] sections)"
        part = (", partial (trailing features)" if math.trailing else ", partial") if math.partial else ""
        part += f", M-RoPE sections merged from ({source.param})" if source.kind == "mrope" else ""
        part += f", tables indexed by {source.param}" if source.kind == "indexed" else ""
        part += ", queries at the tables' last rows" if shape.tail else ""
        part += ", leading tokens passed through" if shape.prefix else ""
        sign = ", by -theta" if math.conjugate else ""
        layout = "complex frequencies" if math.layout == "complex" else f"{math.layout} tables"
        return f"{layout}, {math.pairing} pairing{part}{sign}"


# -- recognition ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parameters:
    """A helper's parameters sorted into roles (:func:`_roles`), or why they cannot be."""

    names: tuple[str, ...] = ()
    rotated: tuple[str, ...] = ()
    tables: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()
    why: str = ""
    keywords: bool = False  # **kwargs


def _roles(helper: Any) -> _Parameters:
    try:
        signature = inspect.signature(helper.forward if isinstance(helper, torch.nn.Module) else helper)
    except (TypeError, ValueError):
        return _Parameters(why="it has no inspectable signature")
    params = list(signature.parameters.values())
    variadic = [p.name for p in params if p.kind == p.VAR_POSITIONAL or (p.kind == p.KEYWORD_ONLY and p.default is p.empty)]
    if variadic:
        return _Parameters(why=f"it takes {', '.join(variadic)} ({signature}), arguments whose meaning torchembed "
                           "cannot probe")
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    table_at = [i for i, name in enumerate(names) if name in _TABLE_NAMES or name.startswith("freqs")]
    tables = tuple(names[i] for i in table_at)
    if not (sorted(tables) == list(_TABLE_NAMES) or (len(tables) == 1 and tables[0].startswith("freqs"))):
        return _Parameters(why=f"its parameters ({', '.join(names)}) name no cos/sin tables nor complex freqs")
    first = table_at[0]
    rotated = names[:first]
    extras = tuple(n for n in names[first:] if n not in tables)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    if not 1 <= len(rotated) <= _ROTATED_LIMIT or table_at != list(range(first, first + len(tables))):
        return _Parameters(why=f"its parameters ({', '.join(names)}) are not tensors to rotate followed by the tables")
    required = [n for n in extras if n not in defaults and n not in (_POSITION_IDS, _MROPE)]
    if required:
        return _Parameters(why=f"it needs {', '.join(required)} ({', '.join(names)}), an input whose meaning torchembed "
                           "does not model")
    optional = tuple(n for n in rotated if n in defaults and defaults[n] is None)
    if rotated[0] in optional:
        return _Parameters(why=f"its first rotated tensor {rotated[0]!r} is optional")
    keywords = any(p.kind == p.VAR_KEYWORD for p in params)
    return _Parameters(names, rotated, tables, optional, extras, tuple(defaults.items()), keywords=keywords)


# Probe shapes: (broadcast rule, x shape, table shape) for batch 2, 3 heads, 5 tokens. "flat": no
# heads axis, the tables broadcast against x as they are.
_PROBES = (("hs", (2, 3, 5), (2, 5)), ("sh", (2, 5, 3), (2, 5)), ("sh", (5, 3), (5,)), ("sh", (2, 5, 3), (5,)),
           ("flat", (2, 5), (2, 5)))


def _tables(theta: Tensor, layout: str) -> tuple[Tensor, ...]:
    if layout == "complex":
        return (torch.polar(torch.ones_like(theta), theta).to(torch.complex64),)
    if layout == "cat":
        theta = torch.cat((theta, theta), dim=-1)
    elif layout == "repeat":
        theta = theta.repeat_interleave(2, dim=-1)
    return theta.cos().float(), theta.sin().float()


def reference_rotate(x: Tensor, cos: Tensor, sin: Tensor, pairing: str, conjugate: bool = False,
                     trailing: bool = False) -> Tensor:
    """Rotate the first (``trailing``: last) ``r = 2 * cos.shape[-1]`` features of ``x`` by half tables broadcastable
    to ``x[..., :r/2]``, with ``pairing`` (float64 inputs: float64 math)."""
    rot = 2 * cos.shape[-1]
    if trailing and x.shape[-1] > rot:
        return torch.cat((x[..., :-rot], reference_rotate(x[..., -rot:], cos, sin, pairing, conjugate)), dim=-1)
    if pairing == "deinterleave":
        x = torch.cat((deinterleave(x[..., :rot]), x[..., rot:]), dim=-1)
        pairing = "half"
    return apply_rotary(x, cos, sin, interleaved=pairing == "interleaved", conjugate=conjugate)


def deinterleave(x: Tensor) -> Tensor:
    """``(x_0, x_1, x_2, x_3, ...)`` -> ``(x_0, x_2, ..., x_1, x_3, ...)``."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def broadcast_table(table: Tensor, rule: str, unsqueeze: int | None = None) -> Tensor:
    """A half table ``(..., s, r/2)`` made to broadcast against rotated tensors (heads axis added)."""
    if rule == "param":
        return table.unsqueeze(unsqueeze)
    if rule == "flat" or table.dim() < 2:
        return table
    return table.unsqueeze(-3 if rule == "hs" else -2)


def _outputs(out: Any, count: int) -> tuple | None:
    if count == 1:
        out = out[0] if isinstance(out, tuple) and len(out) == 2 and out[1] is None else out
        return (out,) if isinstance(out, Tensor) else None
    return out if isinstance(out, tuple) and len(out) == count else None


def _close(got: tuple, want: list[Tensor]) -> bool:
    return all(isinstance(g, Tensor) and g.shape == w.shape and g.is_floating_point()
               and torch.allclose(g.double(), w, rtol=1e-5, atol=1e-5) for g, w in zip(got, want))


_REJECTED = object()  # what _call returns where the helper raises


def _call(helper: Any, *args: Any, **kwargs: Any) -> Any:
    """``helper(*args, **kwargs)`` without autograd, or :data:`_REJECTED` where it rejects these inputs (raises)."""
    try:
        with torch.no_grad():
            return helper(*args, **kwargs)
    except Exception:
        return _REJECTED


def _table_args(roles: _Parameters, tables: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """The probe's ``(cos, sin)`` (or complex freqs) by the helper's table parameters."""
    return dict(zip(roles.tables, tables if roles.tables[0] != "sin" else tables[::-1]))


def _match(helper: Callable, roles: _Parameters, layout: str, feature_dim: int, half: int, gen: torch.Generator,
           keywords: dict | None = None, only: tuple | None = None, probes: tuple = _PROBES) -> list[tuple]:
    """Every (probe, pairing, conjugate, trailing) that ``helper`` computes on inputs of ``feature_dim`` features
    rotated by ``half`` angles, with tables in ``layout``, among ``probes`` (``only``: one probe and one (pairing,
    conjugate)); ``keywords`` passed through."""
    found = []
    for probe in probes:
        rule, x_lead, t_lead = probe
        if only is not None and probe != only[0]:
            continue
        if keywords and UNSQUEEZE_DIM in keywords:  # broadcast as the argument says
            rule = "param"
        theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64) * 6.0 - 3.0
        xs = [torch.randn(*x_lead, feature_dim, generator=gen) for _ in roles.rotated]
        tables = _tables(theta, layout)
        got = _outputs(_call(helper, **dict(zip(roles.rotated, xs)), **_table_args(roles, tables), **(keywords or {})),
                       len(xs))
        if got is None:  # the helper rejects these inputs: not this way of rotating
            continue
        c, s = (broadcast_table(t, rule, (keywords or {}).get(UNSQUEEZE_DIM)) for t in (theta.cos(), theta.sin()))
        for pairing, conjugate, trailing in itertools.product(PAIRINGS, (False, True), (False, True)):
            if only is not None and (pairing, conjugate) != only[1]:
                continue
            if trailing and feature_dim == 2 * half:
                continue
            want = [reference_rotate(x.double(), c, s, pairing, conjugate, trailing) for x in xs]
            if _close(got, want):
                found.append((probe, (pairing, conjugate), trailing))
    return found


_RECOGNIZED: dict[int, tuple[Any, Rotation | None, str]] = {}


def explain(helper: Any) -> str:
    """Why ``helper`` is not recognised, in a few words (for error messages and ``list --all``)."""
    recognize(helper)
    name = getattr(helper, "__qualname__", type(helper).__name__)
    return f"{name}: {_RECOGNIZED[id(helper)][2]}"


def recognize(helper: Any) -> Rotation | None:
    """How ``helper`` rotates, or None if it computes none of the known rotations (cached)."""
    hit = _RECOGNIZED.get(id(helper))
    if hit is not None and hit[0] is helper:
        return hit[1]
    with torch.device("cpu"):  # also where a model is built under a meta (or CUDA) default device
        rotation, why = _probe(helper)
    _RECOGNIZED[id(helper)] = (helper, rotation, why)
    return rotation


def _probe(helper: Any) -> tuple[Rotation | None, str]:
    if not callable(helper) or isinstance(helper, type):
        return None, "not a function"
    roles = _roles(helper)
    if roles.why:
        return None, roles.why
    gen = torch.Generator().manual_seed(0)
    if _POSITION_IDS in roles.extras and _POSITION_IDS not in dict(roles.defaults):
        return _probe_sections(helper, roles, gen) if len(roles.rotated) == 1 else _probe_indexed(helper, roles, gen)
    if _MROPE in roles.extras:
        return _probe_mrope(helper, roles, gen)
    return _probe_plain(helper, roles, gen)


def _probe_plain(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    half = 4
    complex_ = roles.tables[0].startswith("freqs")
    param = UNSQUEEZE_DIM in roles.extras
    found = []
    for layout in ("complex",) if complex_ else LAYOUTS:
        if param:  # both unsqueeze values must do what the argument says
            hs = _match(helper, roles, layout, 2 * half, half, gen, {UNSQUEEZE_DIM: 1}, probes=_PROBES[:1])
            sh = _match(helper, roles, layout, 2 * half, half, gen, {UNSQUEEZE_DIM: 2}, probes=_PROBES[1:2])
            found += [(layout, m) for m in hs if any(n[1] == m[1] for n in sh)]
        else:
            found += [(layout, m) for m in _match(helper, roles, layout, 2 * half, half, gen)]
    kinds = {(layout, m[1]) for layout, m in found}
    if len(kinds) != 1:  # none, or ambiguous (a helper that ignores its inputs)
        return None, "it computes none of the rotations torchembed knows" if not kinds else "its result is ambiguous"
    layout, (probe, (pairing, conjugate), _) = found[0]
    rule = "param" if param else probe[0]
    wide = _match(helper, roles, layout, 4 * half, half, gen, {UNSQUEEZE_DIM: 1} if param else None,
                  only=(_PROBES[0] if param else probe, (pairing, conjugate)))
    trailing = bool(wide) and all(m[2] for m in wide)
    single = _single(helper, roles, layout, half, probe, gen)
    if _POSITION_IDS in roles.extras and not _ignores_positions(helper, roles, layout, half, gen):
        return None, f"its result depends on {_POSITION_IDS}, which torchembed's rotation does not take"
    unknown = [n for n in roles.extras if n not in (UNSQUEEZE_DIM, _POSITION_IDS)]
    if unknown:
        return None, f"it takes {', '.join(unknown)}, which torchembed's rotation does not model"
    patterns = () if param else tuple(dict.fromkeys((p[0], len(p[1]) + 1, len(p[2]) + 1) for _, (p, _, _) in found))
    tail, prefix = (_uneven(helper, roles, layout, half, probe, (pairing, conjugate), param, gen, kind)
                    for kind in ("tail", "prefix"))
    if not param:  # the ranks these calls broadcast by
        patterns += tuple(p for p in (tail, prefix) if p is not None and p not in patterns)
    return Rotation(Call(roles.names, roles.rotated, roles.tables, roles.defaults, roles.keywords, single),
                    Math(layout, pairing, bool(wide), conjugate, trailing),
                    Shape(rule, int(dict(roles.defaults).get(UNSQUEEZE_DIM, 1)), patterns, tail is not None,
                          prefix is not None)), ""


def _from(rotation: Rotation, roles: _Parameters, source: TableSource) -> Rotation:
    """``rotation``, found on a wrapper that fed the helper its tables' source, as the helper's own: its parameters,
    and the tables from ``source``."""
    return replace(rotation, call=replace(rotation.call, params=roles.names), source=source)


def merge_mrope(table: Tensor, sections: Any) -> Tensor:
    """M-RoPE tables ``(3, ..., w)`` (temporal, height, width positions) -> ``(..., w)``: feature section ``i``
    (sections given for one half, repeated for the other) from axis ``i % 3``."""
    parts = table.split([int(n) for n in sections] * 2, dim=-1)
    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


def _probe_mrope(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """transformers 4.x's M-RoPE helpers ``(q, k, cos, sin, mrope_section, unsqueeze_dim=1)``: recognised as the
    rotation they compute on merged tables, then checked with three different position axes."""
    sections = (1, 1, 2)

    def on_merged(**args):  # the helper fed tables that merge into the given ones
        for name in roles.tables:
            args[name] = args[name].expand(3, *args[name].shape)
        return helper(**args, **{_MROPE: list(sections)})

    plain = replace(roles, extras=tuple(n for n in roles.extras if n != _MROPE), keywords=False)
    rotation, why = _probe_plain(on_merged, plain, gen)
    if rotation is None:
        return None, why
    theta = torch.rand(3, 2, 5, 4, generator=gen, dtype=torch.float64) * 6.0 - 3.0  # three position axes
    cos, sin = _tables(theta, rotation.math.layout)
    q, k = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(2))
    got = _call(helper, q, k, cos, sin, list(sections))
    if got is _REJECTED:
        return None, f"it takes {_MROPE} in a way torchembed does not model"
    if rotation.math.layout != "cat":
        return None, f"its {_MROPE} tables are not laid out cat(freqs, freqs)"
    full = torch.cat((theta, theta), dim=-1)
    c, s = (merge_mrope(t, sections)[..., :4].unsqueeze(1) for t in (full.cos(), full.sin()))
    if not _close(_outputs(got, 2) or (), [reference_rotate(x.double(), c, s, rotation.math.pairing) for x in (q, k)]):
        return None, f"its {_MROPE} does not select one position axis per feature section"
    return _from(rotation, roles, TableSource("mrope", _MROPE)), ""


def _probe_indexed(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """Helpers ``(q, k, cos, sin, position_ids, ...)`` that rotate by ``cos[position_ids]`` (tables of every
    position): recognised as the rotation they compute on the gathered tables, then checked with shuffled positions."""

    def on_gathered(**args):  # the helper fed (T, w) tables and the ids that gather the given ones
        lead = args[roles.tables[0]].shape[:-1]
        for name in roles.tables:
            args[name] = args[name].reshape(-1, args[name].shape[-1])
        return helper(**args, **{_POSITION_IDS: torch.arange(lead.numel()).view(lead)})

    plain = replace(roles, extras=tuple(n for n in roles.extras if n != _POSITION_IDS), keywords=False)
    rotation, why = _probe_plain(on_gathered, plain, gen)
    if rotation is None or rotation.shape.broadcast != "param":
        return None, why or f"it takes {_POSITION_IDS} in a way torchembed does not model"
    theta = torch.rand(9, 4, generator=gen, dtype=torch.float64) * 6.0 - 3.0  # a table of 9 positions
    tables = _tables(theta, rotation.math.layout)
    ids = torch.randint(0, 9, (2, 5), generator=gen)
    xs = [torch.randn(2, 3, 5, 8, generator=gen) for _ in roles.rotated]
    got = _call(helper, *xs, *_table_args(roles, tables).values(), ids)
    if got is _REJECTED:
        return None, f"it takes {_POSITION_IDS} in a way torchembed does not model"
    c, s = (t[ids].unsqueeze(1) for t in (theta.cos(), theta.sin()))
    math = rotation.math
    if not _close(_outputs(got, len(xs)) or (), [reference_rotate(x.double(), c, s, math.pairing, math.conjugate) for x in xs]):
        return None, f"its result depends on {_POSITION_IDS} otherwise than by indexing the tables"
    return _from(rotation, roles, TableSource("indexed", _POSITION_IDS)), ""


def _probe_sections(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """Multidimensional RoPE (Gemma 4's vision tower): ``helper(x, cos, sin, position_ids, ...)`` splits the features
    into ``position_ids.shape[-1]`` equal sections and rotates each half-split by its own slice of the (per-section
    ``cat``) tables."""
    unsqueeze = int(dict(roles.defaults).get(UNSQUEEZE_DIM, 1))
    extras = [n for n in roles.extras if n not in (UNSQUEEZE_DIM, _POSITION_IDS)]
    if extras or len(roles.rotated) != 1 or unsqueeze not in (1, 2):
        return None, f"it takes {_POSITION_IDS} ({', '.join(roles.names)}) in a way torchembed does not model"
    sections, width = 2, 8
    lead, t_lead = ((2, 3, 5), (2, 5)) if unsqueeze == 1 else ((2, 5, 3), (2, 5))
    theta = torch.rand(*t_lead, sections, width // 2, generator=gen, dtype=torch.float64) * 6.0 - 3.0
    full = torch.cat((theta, theta), dim=-1).flatten(-2)  # per section: cat(θ, θ)
    x = torch.randn(*lead, sections * width, generator=gen)
    tables = {"cos": full.cos().float(), "sin": full.sin().float()}
    got = _call(helper, x, **tables, position_ids=torch.zeros(*t_lead, sections, dtype=torch.long))
    if got is _REJECTED:
        return None, f"it takes {_POSITION_IDS} ({', '.join(roles.names)}) in a way torchembed does not model"
    c, s = (t.unsqueeze(unsqueeze) for t in (theta.cos(), theta.sin()))
    want = apply_rotary(x.double().unflatten(-1, (sections, width)), c, s).flatten(-2)
    if not (isinstance(got, Tensor) and _close((got,), [want])):
        return None, "it computes none of the rotations torchembed knows"
    broadcast = "param" if UNSQUEEZE_DIM in roles.extras else ("hs" if unsqueeze == 1 else "sh")
    return Rotation(Call(roles.names, roles.rotated, roles.tables, roles.defaults, single=True), Math("cat", "half"),
                    Shape(broadcast, unsqueeze), TableSource("sections", _POSITION_IDS)), ""


def _single(helper: Any, roles: _Parameters, layout: str, half: int, probe: tuple, gen: torch.Generator) -> bool:
    """Whether the helper returns a bare tensor when only its first tensor is given."""
    if len(roles.rotated) == 1:
        return True
    if not roles.optional:
        return False
    _, x_lead, t_lead = probe if probe[0] != "param" else _PROBES[0]
    theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64)
    tables = _tables(theta, layout)
    x = torch.randn(*x_lead, 2 * half, generator=gen)
    return isinstance(_call(helper, **{roles.rotated[0]: x}, **_table_args(roles, tables)), Tensor)


# Probe shapes of tensors whose tokens differ from the tables': (rule, x shape without its tokens'
# axis and features, table shape without its rows and features)
_UNEVEN_PROBES = (("hs", (2, 3), (2,)), ("hs", (2, 3), ()), ("hs", (2, 3), (1,)), ("sh", (2, 3), (2,)), ("sh", (2, 3), ()))


def _uneven(helper: Any, roles: _Parameters, layout: str, half: int, probe: tuple, way: tuple, param: bool,
            gen: torch.Generator, kind: str) -> tuple | None:
    """The probe ``(rule, x rank, table rank)`` on which the helper rotates tensors whose token count differs from the
    tables' (5 rows) this way, or None: ``"tail"``: a first tensor of 3 tokens by the tables' last 3 rows, the others
    (5 tokens) as usual; ``"prefix"``: tensors of 7 tokens, the first 2 passed through, the last 5 rotated."""
    if kind == "tail" and len(roles.rotated) < 2:
        return None
    pairing, conjugate = way
    tokens = [3] + [5] * (len(roles.rotated) - 1) if kind == "tail" else [7] * len(roles.rotated)
    for rule, x_lead, t_lead in _UNEVEN_PROBES:
        if param and rule != "hs":
            continue
        at = len(x_lead) if rule == "hs" else 1  # the tokens' axis: (b, h, s, d) or (b, s, h, d)
        xs = [torch.randn(*x_lead[:at], n, *x_lead[at:], 2 * half, generator=gen) for n in tokens]
        theta = torch.rand(*t_lead, 5, half, generator=gen, dtype=torch.float64) * 6.0 - 3.0
        tables = _tables(theta, layout)
        got = _outputs(_call(helper, **dict(zip(roles.rotated, xs)), **_table_args(roles, tables),
                             **({UNSQUEEZE_DIM: 1} if param else {})), len(xs))
        if got is None:  # the helper rejects these inputs
            continue
        want = []
        for i, x in enumerate(xs):
            angles = theta[..., -3:, :] if kind == "tail" and i == 0 else theta
            c, s = (broadcast_table(t, rule, 1 if param else None) for t in (angles.cos(), angles.sin()))
            if kind == "prefix":
                passed, rotated = x.double().split((2, 5), dim=at)
                want.append(torch.cat((passed, reference_rotate(rotated, c, s, pairing, conjugate)), dim=at))
            else:
                want.append(reference_rotate(x.double(), c, s, pairing, conjugate))
        if _close(got, want):
            return rule, 4, len(t_lead) + 2
    return None


def _ignores_positions(helper: Any, roles: _Parameters, layout: str, half: int, gen: torch.Generator) -> bool:
    """The result with random ``position_ids`` equals the one without (upstream's deprecated argument)."""
    _, x_lead, t_lead = _PROBES[0]
    theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64)
    tables = _tables(theta, layout)
    args = {**{n: torch.randn(*x_lead, 2 * half, generator=gen) for n in roles.rotated}, **_table_args(roles, tables)}
    plain = _call(helper, **args)
    moved = _call(helper, **args, position_ids=torch.randint(0, 5, (2, 5), generator=gen))
    if plain is _REJECTED or moved is _REJECTED:
        return False
    plain, moved = (o if isinstance(o, tuple) else (o,) for o in (plain, moved))
    return all(torch.equal(a, b) for a, b in zip(plain, moved) if isinstance(a, Tensor))
