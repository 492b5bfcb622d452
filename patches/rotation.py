"""Rotation helpers: recognise upstream's by what they compute, and torchembed's replacement.

HF attention code rotates queries and keys with a module-level helper (``apply_rotary_pos_emb``,
``apply_rotary_emb``, ``apply_rotary_pos_emb_vision`` ...) fed with tables that the model's rotary
module builds. Helpers differ in their parameters, in how the tables are laid out, in which
features they pair, and in how the tables broadcast against q and k. Instead of a list of names,
torchembed *probes* each candidate helper once (:func:`recognize`): it calls it on random float32
inputs built for every known way of rotating and keeps the one whose result matches a float64
rotation to 1e-5:

* parameters, by name: the rotated tensors come first (``q, k``; ``x``; ``q, k, v`` ...; a rotated
  tensor whose default is None is optional), then the tables: ``cos, sin`` (either order) or one
  complex ``freqs*`` tensor (``cos + i sin``, Llama 4 and DeepSeek-V2), then extras that must have
  defaults: ``unsqueeze_dim`` (the tables are unsqueezed there) and ``position_ids`` (only where the
  probe shows the result does not depend on it);
* broadcast: tables ``(b, s, w)`` or ``(s, w)`` against ``(..., h, s, d)`` (``"hs"``: HF's usual,
  after the heads transpose) or ``(..., s, h, d)`` (``"sh"``: GPT-J, Llama 4, vision towers), or
  as the ``unsqueeze_dim`` argument says (``"param"``);
* table layout: ``cat`` (``(θ_0..θ_{r/2-1}, θ_0..θ_{r/2-1})``, LLaMA and most), ``repeat``
  (``(θ_0, θ_0, θ_1, ...)``, Cohere), ``half`` (``r/2`` entries, GPT-J) or ``complex``;
* pairing: ``half`` ``(x_i, x_{i+r/2})``, ``interleaved`` ``(x_{2i}, x_{2i+1})`` in place, or
  ``deinterleave`` (``(x_{2i}, x_{2i+1})`` written in half-split order, DeepSeek-V3); by ``-θ``
  where a helper rotates the other way; ``partial``: only the leading (or trailing) ``r`` features
  of a wider input.

The replacement (:class:`RotaryHelper`) accepts every way upstream's signature can be called
(positional or keyword arguments, an optional tensor left out) and rotates with
:func:`torchembed.kernels.rotary_fused` where the kernel can run and ``fused`` allows it, and with
the float32 PyTorch reference elsewhere; both compute in float32 and round once. It never calls
upstream's helper.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchembed import functional, kernels
from torchembed.functional.rope import apply_rotary
from torchembed.kernels.availability import FusedUnavailableError
from torchembed.kernels.rope import use_rope_kernel

__all__ = ["Rotation", "RotaryHelper", "explain", "recognize", "is_rotation_name"]

LAYOUTS = ("cat", "repeat", "half")
PAIRINGS = ("half", "interleaved", "deinterleave")
_TABLE_NAMES = ("cos", "sin")
_ROTATED_LIMIT = 3  # q, k and v at most
_UNSQUEEZE = "unsqueeze_dim"
_POSITION_IDS = "position_ids"
_MROPE = "mrope_section"


def is_rotation_name(name: str) -> bool:
    """A global's name that may be a rotation helper (``apply_rotary_pos_emb``, ``apply_rope`` ...)."""
    lowered = name.lower()
    return ("rotary" in lowered or "rope" in lowered) and not lowered.isupper()


@dataclass(frozen=True)
class Rotation:
    """How an upstream helper rotates, as found by :func:`recognize`."""

    params: tuple[str, ...]  # the helper's positional-or-keyword parameters
    rotated: tuple[str, ...]  # the tensors it rotates, in order
    tables: tuple[str, ...]  # ("cos", "sin") or ("sin", "cos") in parameter order, or (freqs name,)
    layout: str  # one of LAYOUTS, or "complex"
    pairing: str  # one of PAIRINGS
    broadcast: str  # "hs" | "sh" | "param"
    partial: bool = False  # rotates the leading r features of a wider input, the rest pass through
    conjugate: bool = False  # rotates by -theta
    trailing: bool = False  # with partial: the last r features rotate, the leading ones pass (DeepSeek-V4)
    optional: tuple[str, ...] = ()  # rotated tensors that may be left out (default None)
    single: bool = False  # returns a bare tensor when one tensor is rotated (else a tuple, None for left-out ones)
    unsqueeze_default: int = 1  # with broadcast "param"
    ignored: tuple[str, ...] = ()  # extra parameters the result does not depend on (position_ids)
    sections: str = ""  # the parameter whose last dim counts the feature sections (multidimensional RoPE)
    mrope: str = ""  # the parameter of M-RoPE sections: tables (3, ..., w), one axis per section (transformers 4.x)
    indexed: str = ""  # the parameter of position ids that index (T, w) tables (older transformers)
    tail: bool = False  # a first tensor with fewer tokens than the tables takes their last rows (a drafter's
    # queries over keys that carry the target model's context: Muse Glimmer's assistant)
    prefix: bool = False  # tensors with more tokens than the tables: the leading ones pass (DINOv3's cls and registers)
    keywords: bool = False  # the helper takes **kwargs (never given by the attentions: a call with any is refused)
    # (rule, rank of x, rank of the tables) of every probe the helper passed: a helper that inserts the
    # heads axis at a fixed place broadcasts (s, w) tables against (s, h, d) as "sh", (b, s, w) as "hs"
    patterns: tuple[tuple[str, int, int], ...] = ()

    def rule_for(self, x: Tensor, table: Tensor) -> str:
        """The broadcast rule of a call with these ranks (the first probed rule where none fits)."""
        ranks = (x.dim(), table.dim())
        return next((rule for rule, *probed in self.patterns if tuple(probed) == ranks), self.broadcast)

    def half_tables(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor]:
        """The helper's tables (``cos, sin`` or ``freqs``) -> cos and sin of the ``r/2`` angles."""
        if self.layout == "complex":
            pairs = torch.view_as_real(first)
            return pairs[..., 0], pairs[..., 1]
        cos, sin = (first, second) if self.tables[0] == "cos" else (second, first)
        if self.layout == "cat":
            half = cos.shape[-1] // 2
            return cos[..., :half], sin[..., :half]
        if self.layout == "repeat":
            return cos[..., ::2], sin[..., ::2]
        return cos, sin

    def describe(self) -> str:
        if self.sections:
            return f"{self.layout} tables, {self.pairing} pairing per feature section ({self.sections}.shape[-1] sections)"
        part = (", partial (trailing features)" if self.trailing else ", partial") if self.partial else ""
        part += f", M-RoPE sections merged from ({self.mrope})" if self.mrope else ""
        part += f", tables indexed by {self.indexed}" if self.indexed else ""
        part += ", queries at the tables' last rows" if self.tail else ""
        part += ", leading tokens passed through" if self.prefix else ""
        sign = ", by -theta" if self.conjugate else ""
        layout = "complex frequencies" if self.layout == "complex" else f"{self.layout} tables"
        return f"{layout}, {self.pairing} pairing{part}{sign}"


# -- recognition ---------------------------------------------------------------------------------


def _signature(helper: Any) -> inspect.Signature | None:
    target = helper.forward if isinstance(helper, torch.nn.Module) else helper
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


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
    signature = _signature(helper)
    if signature is None:
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
    """Rotate the first (``trailing``: last) ``r = 2 * cos.shape[-1]`` features of ``x`` by half
    tables broadcastable to ``x[..., :r/2]``, with ``pairing`` (float64 inputs: float64 math)."""
    rot = 2 * cos.shape[-1]
    if trailing and x.shape[-1] > rot:
        return torch.cat((x[..., :-rot], reference_rotate(x[..., -rot:], cos, sin, pairing, conjugate)), dim=-1)
    if pairing == "deinterleave":
        x = torch.cat((_deinterleave(x[..., :rot]), x[..., rot:]), dim=-1)
        pairing = "half"
    return apply_rotary(x, cos, sin, interleaved=pairing == "interleaved", conjugate=conjugate)


def _deinterleave(x: Tensor) -> Tensor:
    """``(x_0, x_1, x_2, x_3, ...)`` -> ``(x_0, x_2, ..., x_1, x_3, ...)``."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _broadcast(table: Tensor, rule: str, unsqueeze: int | None = None) -> Tensor:
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


def _match(helper: Callable, roles: _Parameters, layout: str, feature_dim: int, half: int, gen: torch.Generator,
           keywords: dict | None = None, only: tuple | None = None, probes: tuple = _PROBES) -> list[tuple]:
    """Every (probe, pairing, conjugate, trailing) that ``helper`` computes on inputs of ``feature_dim``
    features rotated by ``half`` angles, with tables in ``layout``, among ``probes`` (``only``: one probe
    and one (pairing, conjugate)); ``keywords`` passed through."""
    found = []
    for probe in probes:
        rule, x_lead, t_lead = probe
        if only is not None and probe != only[0]:
            continue
        if keywords and _UNSQUEEZE in keywords:  # broadcast as the argument says
            rule = "param"
        theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64) * 6.0 - 3.0
        xs = [torch.randn(*x_lead, feature_dim, generator=gen) for _ in roles.rotated]
        tables = _tables(theta, layout)
        args = dict(zip(roles.rotated, xs), **dict(zip(roles.tables, tables if roles.tables[0] != "sin" else tables[::-1])))
        try:
            with torch.no_grad():
                got = _outputs(helper(**args, **(keywords or {})), len(xs))
        except Exception:  # the helper rejects these inputs: not this way of rotating
            continue
        if got is None:
            continue
        c, s = (_broadcast(t, rule, (keywords or {}).get(_UNSQUEEZE)) for t in (theta.cos(), theta.sin()))
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
    param = _UNSQUEEZE in roles.extras
    found = []
    for layout in ("complex",) if complex_ else LAYOUTS:
        if param:  # both unsqueeze values must do what the argument says
            hs = _match(helper, roles, layout, 2 * half, half, gen, {_UNSQUEEZE: 1}, probes=_PROBES[:1])
            sh = _match(helper, roles, layout, 2 * half, half, gen, {_UNSQUEEZE: 2}, probes=_PROBES[1:2])
            found += [(layout, m) for m in hs if any(n[1] == m[1] for n in sh)]
        else:
            found += [(layout, m) for m in _match(helper, roles, layout, 2 * half, half, gen)]
    kinds = {(layout, m[1]) for layout, m in found}
    if len(kinds) != 1:  # none, or ambiguous (a helper that ignores its inputs)
        return None, "it computes none of the rotations torchembed knows" if not kinds else "its result is ambiguous"
    layout, (probe, (pairing, conjugate), _) = found[0]
    rule = "param" if param else probe[0]
    wide = _match(helper, roles, layout, 4 * half, half, gen, {_UNSQUEEZE: 1} if param else None,
                  only=(_PROBES[0] if param else probe, (pairing, conjugate)))
    partial = bool(wide)
    trailing = partial and all(m[2] for m in wide)
    single = _single(helper, roles, layout, half, probe, gen)
    ignored = tuple(n for n in roles.extras if n == _POSITION_IDS)
    if ignored and not _ignores_positions(helper, roles, layout, half, gen):
        return None, f"its result depends on {_POSITION_IDS}, which torchembed's rotation does not take"
    unknown = [n for n in roles.extras if n not in (_UNSQUEEZE, _POSITION_IDS)]
    if unknown:
        return None, f"it takes {', '.join(unknown)}, which torchembed's rotation does not model"
    defaults = dict(roles.defaults)
    patterns = () if param else tuple(dict.fromkeys((p[0], len(p[1]) + 1, len(p[2]) + 1) for _, (p, _, _) in found))
    tail, prefix = (_uneven(helper, roles, layout, half, probe, (pairing, conjugate), param, gen, kind)
                    for kind in ("tail", "prefix"))
    if not param:  # the ranks these calls broadcast by
        patterns += tuple(p for p in (tail, prefix) if p is not None and p not in patterns)
    return Rotation(roles.names, roles.rotated, roles.tables, layout, pairing, rule, partial, conjugate, trailing,
                    roles.optional, single, int(defaults.get(_UNSQUEEZE, 1)), ignored, patterns=patterns, tail=tail is not None,
                    prefix=prefix is not None, keywords=roles.keywords), ""


def merge_mrope(table: Tensor, sections: Any) -> Tensor:
    """M-RoPE tables ``(3, ..., w)`` (temporal, height, width positions) -> ``(..., w)``: feature
    section ``i`` (sections given for one half, repeated for the other) from axis ``i % 3``."""
    parts = table.split([int(n) for n in sections] * 2, dim=-1)
    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


def _probe_mrope(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """transformers 4.x's M-RoPE helpers ``(q, k, cos, sin, mrope_section, unsqueeze_dim=1)``: recognised
    as the rotation they compute on merged tables, then checked with three different position axes."""
    sections = (1, 1, 2)

    def on_merged(**args):  # the helper fed tables that merge into the given ones
        for name in roles.tables:
            args[name] = args[name].expand(3, *args[name].shape)
        return helper(**args, **{_MROPE: list(sections)})

    plain = _Parameters(roles.names, roles.rotated, roles.tables, roles.optional,
                        tuple(n for n in roles.extras if n != _MROPE), roles.defaults)
    rotation, why = _probe_plain(on_merged, plain, gen)
    if rotation is None:
        return None, why
    theta = torch.rand(3, 2, 5, 4, generator=gen, dtype=torch.float64) * 6.0 - 3.0  # three position axes
    cos, sin = _tables(theta, rotation.layout)
    q, k = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(2))
    try:
        with torch.no_grad():
            got = helper(q, k, cos, sin, list(sections))
    except Exception:
        return None, f"it takes {_MROPE} in a way torchembed does not model"
    if rotation.layout != "cat":
        return None, f"its {_MROPE} tables are not laid out cat(freqs, freqs)"
    full = torch.cat((theta, theta), dim=-1)
    c, s = (merge_mrope(t, sections)[..., :4].unsqueeze(1) for t in (full.cos(), full.sin()))
    if not _close(_outputs(got, 2) or (), [reference_rotate(x.double(), c, s, rotation.pairing) for x in (q, k)]):
        return None, f"its {_MROPE} does not select one position axis per feature section"
    return Rotation(**{**rotation.__dict__, "params": roles.names, "mrope": _MROPE}), ""


def _probe_indexed(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """Helpers ``(q, k, cos, sin, position_ids, ...)`` that rotate by ``cos[position_ids]`` (tables of
    every position): recognised as the rotation they compute on the gathered tables, then checked with
    shuffled positions."""

    def on_gathered(**args):  # the helper fed (T, w) tables and the ids that gather the given ones
        lead = args[roles.tables[0]].shape[:-1]
        for name in roles.tables:
            args[name] = args[name].reshape(-1, args[name].shape[-1])
        return helper(**args, **{_POSITION_IDS: torch.arange(lead.numel()).view(lead)})

    plain = _Parameters(roles.names, roles.rotated, roles.tables, roles.optional,
                        tuple(n for n in roles.extras if n != _POSITION_IDS), roles.defaults)
    rotation, why = _probe_plain(on_gathered, plain, gen)
    if rotation is None or rotation.broadcast != "param":
        return None, why or f"it takes {_POSITION_IDS} in a way torchembed does not model"
    theta = torch.rand(9, 4, generator=gen, dtype=torch.float64) * 6.0 - 3.0  # a table of 9 positions
    tables = _tables(theta, rotation.layout)
    ids = torch.randint(0, 9, (2, 5), generator=gen)
    xs = [torch.randn(2, 3, 5, 8, generator=gen) for _ in roles.rotated]
    try:
        with torch.no_grad():
            got = helper(*xs, *(tables if roles.tables[0] != "sin" else tables[::-1]), ids)
    except Exception:
        return None, f"it takes {_POSITION_IDS} in a way torchembed does not model"
    c, s = (t[ids].unsqueeze(1) for t in (theta.cos(), theta.sin()))
    if not _close(_outputs(got, len(xs)) or (), [reference_rotate(x.double(), c, s, rotation.pairing, rotation.conjugate)
                                                 for x in xs]):
        return None, f"its result depends on {_POSITION_IDS} otherwise than by indexing the tables"
    return Rotation(**{**rotation.__dict__, "params": roles.names, "indexed": _POSITION_IDS}), ""


def _probe_sections(helper: Any, roles: _Parameters, gen: torch.Generator) -> tuple[Rotation | None, str]:
    """Multidimensional RoPE (Gemma 4's vision tower): ``helper(x, cos, sin, position_ids, ...)`` splits
    the features into ``position_ids.shape[-1]`` equal sections and rotates each half-split by its own
    slice of the (per-section ``cat``) tables."""
    defaults = dict(roles.defaults)
    unsqueeze = int(defaults.get(_UNSQUEEZE, 1))
    extras = [n for n in roles.extras if n not in (_UNSQUEEZE, _POSITION_IDS)]
    if extras or len(roles.rotated) != 1 or unsqueeze not in (1, 2):
        return None, f"it takes {_POSITION_IDS} ({', '.join(roles.names)}) in a way torchembed does not model"
    sections, width = 2, 8
    lead, t_lead = ((2, 3, 5), (2, 5)) if unsqueeze == 1 else ((2, 5, 3), (2, 5))
    theta = torch.rand(*t_lead, sections, width // 2, generator=gen, dtype=torch.float64) * 6.0 - 3.0
    full = torch.cat((theta, theta), dim=-1).flatten(-2)  # per section: cat(θ, θ)
    x = torch.randn(*lead, sections * width, generator=gen)
    tables = {"cos": full.cos().float(), "sin": full.sin().float()}
    try:
        with torch.no_grad():
            got = helper(x, **tables, position_ids=torch.zeros(*t_lead, sections, dtype=torch.long))
    except Exception:
        return None, f"it takes {_POSITION_IDS} ({', '.join(roles.names)}) in a way torchembed does not model"
    c, s = (t.unsqueeze(unsqueeze) for t in (theta.cos(), theta.sin()))
    want = apply_rotary(x.double().unflatten(-1, (sections, width)), c, s).flatten(-2)
    if not (isinstance(got, Tensor) and _close((got,), [want])):
        return None, "it computes none of the rotations torchembed knows"
    return Rotation(roles.names, roles.rotated, roles.tables, "cat", "half", "param" if _UNSQUEEZE in roles.extras
                    else ("hs" if unsqueeze == 1 else "sh"), single=True, unsqueeze_default=unsqueeze,
                    sections=_POSITION_IDS), ""


def _single(helper: Any, roles: _Parameters, layout: str, half: int, probe: tuple, gen: torch.Generator) -> bool:
    """Whether the helper returns a bare tensor when only its first tensor is given."""
    if len(roles.rotated) == 1:
        return True
    if not roles.optional:
        return False
    _, x_lead, t_lead = probe if probe[0] != "param" else _PROBES[0]
    theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64)
    tables = _tables(theta, layout)
    args = {roles.rotated[0]: torch.randn(*x_lead, 2 * half, generator=gen),
            **dict(zip(roles.tables, tables if roles.tables[0] != "sin" else tables[::-1]))}
    try:
        with torch.no_grad():
            out = helper(**args)
    except Exception:
        return False
    return isinstance(out, Tensor)


# Probe shapes of tensors whose tokens differ from the tables': (rule, x shape without its tokens'
# axis and features, table shape without its rows and features)
_UNEVEN_PROBES = (("hs", (2, 3), (2,)), ("hs", (2, 3), ()), ("hs", (2, 3), (1,)), ("sh", (2, 3), (2,)), ("sh", (2, 3), ()))


def _uneven(helper: Any, roles: _Parameters, layout: str, half: int, probe: tuple, way: tuple, param: bool,
            gen: torch.Generator, kind: str) -> tuple | None:
    """The probe ``(rule, x rank, table rank)`` on which the helper rotates tensors whose token count
    differs from the tables' (5 rows) this way, or None: ``"tail"``: a first tensor of 3 tokens by the
    tables' last 3 rows, the others (5 tokens) as usual; ``"prefix"``: tensors of 7 tokens, the first
    2 passed through, the last 5 rotated."""
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
        args = dict(zip(roles.rotated, xs), **dict(zip(roles.tables, tables if roles.tables[0] != "sin" else tables[::-1])))
        try:
            with torch.no_grad():
                got = _outputs(helper(**args, **({_UNSQUEEZE: 1} if param else {})), len(xs))
        except Exception:  # the helper rejects these inputs
            continue
        want = []
        for i, x in enumerate(xs):
            angles = theta[..., -3:, :] if kind == "tail" and i == 0 else theta
            c, s = (_broadcast(t, rule, 1 if param else None) for t in (angles.cos(), angles.sin()))
            if kind == "prefix":
                passed, rotated = x.double().split((2, 5), dim=at)
                want.append(torch.cat((passed, reference_rotate(rotated, c, s, pairing, conjugate)), dim=at))
            else:
                want.append(reference_rotate(x.double(), c, s, pairing, conjugate))
        if got is not None and _close(got, want):
            return rule, 4, len(t_lead) + 2
    return None


def _ignores_positions(helper: Any, roles: _Parameters, layout: str, half: int, gen: torch.Generator) -> bool:
    """The result with random ``position_ids`` equals the one without (upstream's deprecated argument)."""
    _, x_lead, t_lead = _PROBES[0]
    theta = torch.rand(*t_lead, half, generator=gen, dtype=torch.float64)
    tables = _tables(theta, layout)
    args = {**{n: torch.randn(*x_lead, 2 * half, generator=gen) for n in roles.rotated},
            **dict(zip(roles.tables, tables if roles.tables[0] != "sin" else tables[::-1]))}
    try:
        with torch.no_grad():
            plain = helper(**args)
            moved = helper(**args, position_ids=torch.randint(0, 5, (2, 5), generator=gen))
    except Exception:
        return False
    plain, moved = (o if isinstance(o, tuple) else (o,) for o in (plain, moved))
    return all(torch.equal(a, b) for a, b in zip(plain, moved) if isinstance(a, Tensor))


# -- replacement -----------------------------------------------------------------------------------


class RotaryHelper:
    """torchembed's drop-in for one upstream rotation helper: the same parameters, the same results.

    Called as upstream is (positional or keyword arguments, optional tensors left out); rotates in
    float32 and rounds once: with :func:`torchembed.kernels.rotary_fused` (q and k in one launch;
    at inference HF's usual ``helper(q, k, cos, sin)`` rotates in place: upstream binds its names to
    the returned tensors, which are they) where :func:`~torchembed.kernels.rope.use_rope_kernel` says
    so, with :func:`torchembed.functional.apply_rotary` elsewhere (upstream's products and sum in
    float32, rounded once). Upstream's helper is never called.

    One instance per (rotation, upstream, fused) (:meth:`get`), so the rebound attention code is
    shared by every model patched the same way; it pickles as those three.
    """

    _INSTANCES: dict[tuple, "RotaryHelper"] = {}

    def __init__(self, rotation: Rotation, upstream: Callable, fused: bool | None) -> None:
        self.rotation, self.upstream, self.fused = rotation, upstream, fused
        self.__name__ = self.__qualname__ = f"torchembed_{getattr(upstream, '__name__', 'rotary')}"
        self._names = frozenset(rotation.params)
        self._defaults = dict(_roles(upstream).defaults)
        # HF's usual call helper(q, k, cos, sin) on cat tables, half-split pairing, (..., h, s, d):
        # served by _usual (in place on the kernel, or the fused CPU arithmetic).
        self._usual = (len(rotation.rotated) == 2 and rotation.params[2:4] == ("cos", "sin")
                       and rotation.layout == "cat" and rotation.pairing == "half" and not rotation.conjugate
                       and not rotation.trailing and rotation.broadcast in ("hs", "param")
                       and rotation.unsqueeze_default == 1 and not rotation.mrope and not rotation.indexed
                       and not rotation.tail and not rotation.prefix)
        self._tables: tuple | None = None  # the last tables and their half tables (one forward's)
        self._mrope: tuple | None = None  # the last M-RoPE tables and their merged ones
        self._prep: tuple | None = None  # the last tables and their PyTorch-path forms (:meth:`_prepared`)

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
        if self._usual and len(args) == 4 and not kwargs:
            out = self._usual_call(*args)
            if out is not None:
                return out
        return self._serve(self._bind(args, kwargs))

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Upstream's parameter names -> the values of this call (defaults filled in); a TypeError
        where upstream would raise one."""
        params = self.rotation.params
        if len(args) > len(params):
            raise TypeError(f"{self.__name__}() takes {len(params)} positional arguments but {len(args)} were given")
        values = dict(zip(params, args))
        for name, value in kwargs.items():
            if name not in self._names:
                if self.rotation.keywords:  # upstream would take it into **kwargs, with a meaning not probed
                    raise TypeError(f"{self.__name__}(): upstream's helper takes **kwargs, and torchembed's rotation "
                                    f"does not know what {name!r} means to it; unpatch to call it with {name!r}")
                raise TypeError(f"{self.__name__}() got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{self.__name__}() got multiple values for argument {name!r}")
            values[name] = value
        for name in params:
            if name not in values:
                if name not in self._defaults:
                    raise TypeError(f"{self.__name__}() missing required argument {name!r}")
                values[name] = self._defaults[name]
        return values

    def _serve(self, values: dict[str, Any]) -> Any:
        """The rotation of one bound call, returned as upstream returns it."""
        rotation = self.rotation
        first, second = (values[name] for name in rotation.tables) if len(rotation.tables) == 2 else (values[rotation.tables[0]], None)
        if rotation.mrope:
            first, second = self._merged(first, second, values[rotation.mrope])
        elif rotation.indexed:  # (T, w) tables of every position: this call's rows
            ids = values[rotation.indexed]
            first, second = first[ids], second[ids]
        c, s = self._half(first, second)
        full = self._own_tables(first, second)
        u = values.get(_UNSQUEEZE, rotation.unsqueeze_default) if rotation.broadcast == "param" else None
        xs = [values[name] for name in rotation.rotated]
        if rotation.sections:
            return self._rotate_sections(xs[0], first, second, values[rotation.sections].shape[-1],
                                         rotation.unsqueeze_default if u is None else u)
        given = [x for x in xs if x is not None]
        rule = _unsqueezed_rule(u, c.dim()) if rotation.broadcast == "param" else rotation.rule_for(given[0], c) if given else ""
        at = -2 if rule == "hs" else -3  # the tokens' axis (tail, prefix)
        first = given[0].shape[at] if given else 0
        if rotation.prefix and given and first > c.shape[-2]:  # the leading tokens pass through
            lead = first - c.shape[-2]
            parts = [x.split((lead, x.shape[at] - lead), dim=at) for x in given]
            rotated = iter(torch.cat((p, r), dim=at) for p, r in
                           zip((p for p, _ in parts), self.rotate([r for _, r in parts], c, s, u, full)))
        elif rotation.tail and len(given) > 1 and first < c.shape[-2]:  # the first tensor: the tables' last rows
            last = (lambda t: t[..., -first:, :]) if first else (lambda t: t[..., :0, :])
            rotated = iter(self.rotate(given[:1], last(c), last(s), u, full and (last(full[0]), last(full[1])))
                           + self.rotate(given[1:], c, s, u, full))
        else:
            rotated = iter(self.rotate(given, c, s, u, full))
        out = tuple(None if x is None else next(rotated) for x in xs)
        return out[0] if rotation.single and len(given) == 1 else out

    def _merged(self, first: Tensor, second: Tensor, sections: Any) -> tuple[Tensor, Tensor]:
        """M-RoPE tables merged (:func:`merge_mrope`), once per forward."""
        kept = self._mrope
        if kept is not None and kept[0] is first and kept[1] is second and kept[2] == list(sections):
            return kept[3], kept[4]
        merged = merge_mrope(first, sections), merge_mrope(second, sections)
        if not torch.compiler.is_compiling():
            self._mrope = (first, second, list(sections), *merged)
        return merged

    def _rotate_sections(self, x: Tensor, first: Tensor, second: Tensor, sections: int, unsqueeze: int) -> Tensor:
        """Multidimensional RoPE: ``x (..., d)`` as ``sections`` equal feature sections, each rotated
        half-split by its slice of the tables (PyTorch operations; the kernel takes one table per token)."""
        if self.fused and use_rope_kernel(self.fused, x):
            raise FusedUnavailableError(f"fused=True: {self.__name__} rotates per feature section, which the fused "
                                        "kernel does not; patch with fused=None")
        width = 2 * (x.shape[-1] // (2 * sections)) if sections > 0 else 0
        if width == 0 or width * sections != x.shape[-1]:
            raise ValueError(f"{self.__name__}: {x.shape[-1]} features do not split into {sections} rotated sections")
        cos, sin = (first, second) if self.rotation.tables[0] == "cos" else (second, first)
        at = unsqueeze if unsqueeze >= 0 else unsqueeze - 1  # the sections' axis comes last
        c, s = (t.unflatten(-1, (sections, width))[..., : width // 2].unsqueeze(at) for t in (cos, sin))
        return apply_rotary(x.unflatten(-1, (sections, width)), c, s).flatten(-2)

    def _half(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor]:
        """The half tables of ``(first, second)``, kept while the same tables come (every layer of a
        forward gets the same ones)."""
        kept = self._tables
        if kept is not None and kept[0] is first and kept[1] is second:
            return kept[2], kept[3]
        c, s = self.rotation.half_tables(first, second)
        if self.rotation.layout == "complex":  # views of every other float: copied once per forward
            c, s = c.contiguous(), s.contiguous()
        if not torch.compiler.is_compiling():
            self._tables = (first, second, c, s)
        return c, s

    def _own_tables(self, first: Tensor, second: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The helper's own ``(cos, sin)`` where it multiplies each feature by its own entry (``cat``
        tables with half-split pairing, ``repeat`` tables with interleaved pairing), else None. The PyTorch path multiplies by them as upstream does, so it
        computes upstream's function also where a feature pair's two entries differ (HunYuan-VL's
        M-RoPE sections span both halves of the head: at an image token they are two axes' angles)."""
        rotation = self.rotation
        if not ((rotation.layout == "cat" and rotation.pairing in ("half", "deinterleave"))
                or (rotation.layout == "repeat" and rotation.pairing == "interleaved")):
            return None  # (other pairings of these layouts rearrange the tables inside the helper)
        return (first, second) if self.rotation.tables[0] == "cos" else (second, first)

    def rotate(self, xs: list[Tensor], c: Tensor, s: Tensor, unsqueeze: int | None,
               full: tuple[Tensor, Tensor] | None = None) -> list[Tensor]:
        """``xs`` rotated by half tables ``c``/``s`` ``(..., s, r/2)`` (broadcast as the helper does,
        ``unsqueeze``: its unsqueeze_dim argument; ``full``: :meth:`_own_tables`): on the kernel (one launch
        for two tensors) where the layout allows and the kernel runs, else in PyTorch.

        Raises:
            ValueError: a tensor narrower than the rotated features, or wider for a helper that
                rotates them all.
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
            tails = self._rotate_leading([x[..., -rot:] for x in xs], c, s, unsqueeze, full)
            return [torch.cat((x[..., :-rot], tail), dim=-1) for x, tail in zip(xs, tails)]
        return self._rotate_leading(xs, c, s, unsqueeze, full)

    def _rotate_leading(self, xs: list[Tensor], c: Tensor, s: Tensor, unsqueeze: int | None,
                        full: tuple[Tensor, Tensor] | None) -> list[Tensor]:
        rotation = self.rotation
        rot = 2 * c.shape[-1]
        pairing = rotation.pairing
        if pairing == "deinterleave":  # reorder once (a copy), then rotate half-split
            xs = [torch.cat((_deinterleave(x[..., :rot]), x[..., rot:]), dim=-1) for x in xs]
            pairing = "half"
        interleaved = pairing == "interleaved"
        rule = "param" if rotation.broadcast == "param" else rotation.rule_for(xs[0], c)
        if rule != "param":  # tables as (n, S, r/2) rows, whatever singleton axes they carry
            c, s = _rows(c, xs[0], rule), _rows(s, xs[0], rule)
            full = None if full is None else (_rows(full[0], xs[0], rule), _rows(full[1], xs[0], rule))
        kernel_rule = _kernel_rule(rule, unsqueeze, c, xs[0])
        views = self._kernel_views(xs, c, kernel_rule) if use_rope_kernel(self.fused, xs[0]) else None
        if views is None and self.fused:
            raise FusedUnavailableError(f"fused=True: {self.__name__} was called with tensors of shapes "
                                        f"{[tuple(x.shape) for x in xs]} and tables {tuple(c.shape)}, a layout the fused "
                                        "kernel does not take; patch with fused=None")
        if views is not None:
            bhsd, tables_view = views
            halves = full is not None and not interleaved  # the helper's own rows: a pair's second feature its entries
            if halves:
                cb, sb = (tables_view(t) for t in full)
            else:
                cb, sb = tables_view(c), tables_view(s)
            outs, i = [], 0
            while i < len(bhsd):  # two tensors per launch where they pair up
                if i + 1 < len(bhsd) and _pairable(bhsd[i], bhsd[i + 1]):
                    outs += kernels.rotary_fused(bhsd[i], bhsd[i + 1], cb, sb, interleaved=interleaved,
                                                 conjugate=rotation.conjugate, halves=halves)
                    i += 2
                else:
                    outs.append(kernels.rotary_fused(bhsd[i], bhsd[i][:, :0], cb, sb, interleaved=interleaved,
                                                     conjugate=rotation.conjugate, halves=halves)[0])
                    i += 1
            return [_back(x, kernel_rule)(o) for x, o in zip(xs, outs)]
        return self._arithmetic(xs, c, s, full, unsqueeze, interleaved, rule)

    def _arithmetic(self, xs: list[Tensor], c: Tensor, s: Tensor, full: tuple[Tensor, Tensor] | None,
                    unsqueeze: int | None, interleaved: bool, rule: str) -> list[Tensor]:
        """The PyTorch path: :func:`torchembed.functional.apply_rotary` on each tensor, with the
        helper's own full-width tables where it has them (``full``: each feature its own entry, as
        upstream multiplies), else the half tables, broadcast as the helper broadcasts them."""
        cb, sb = self._prepared(full if full is not None else (c, s), rule, unsqueeze, xs[0].dtype)
        return [functional.apply_rotary(x, cb, sb, interleaved=interleaved, conjugate=self.rotation.conjugate,
                                        full=full is not None) for x in xs]

    def _prepared(self, tables: tuple[Tensor, Tensor], rule: str, unsqueeze: int | None,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``tables`` broadcast as the helper does and in the rotation's compute dtype (float32, or
        float64 for float64 inputs), kept while the same tables come: every layer of a forward gets
        the same ones, so the PyTorch path converts them once per forward, not once per tensor."""
        key = (rule, unsqueeze, torch.float64 if dtype == torch.float64 else torch.float32)
        kept = self._prep
        if kept is not None and kept[0] is tables[0] and kept[1] is tables[1] and kept[2] == key:
            return kept[3], kept[4]
        cb, sb = (_broadcast(t, rule, unsqueeze).to(key[2]) for t in tables)
        if not torch.compiler.is_compiling():
            self._prep = (tables[0], tables[1], key, cb, sb)
        return cb, sb

    def _kernel_views(self, xs: list[Tensor], c: Tensor, rule: str | None):
        """``xs`` as the kernel's ``(B, H, S, D)`` views and a function making ``(B or 1, S, R/2)``
        tables of the half tables; None for layouts the kernel does not take."""
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

    def _usual_call(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor] | None:
        """HF's usual call, with less Python around it: on the kernel at inference in place (one cache
        lookup and one launch per layer; a call the kernel does not take goes the general way), else
        :func:`torchembed.functional.apply_rotary` with upstream's own tables. None: the general way."""
        if q.shape[-1] != cos.shape[-1]:
            return None
        if use_rope_kernel(self.fused, q):
            # In place at inference; out of place where autograd records or torch.compile traces.
            inplace = not (torch.compiler.is_compiling() or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))
            try:  # (HF's full-width rows: each feature its own entry, as upstream's arithmetic)
                return kernels.rotary_fused(q, k, cos, sin, inplace=inplace, halves=True)
            except ValueError:
                return None
        cb, sb = self._prepared((cos, sin), self.rotation.broadcast, 1, q.dtype)
        return functional.apply_rotary(q, cb, sb, full=True), functional.apply_rotary(k, cb, sb, full=True)


def _rows(table: Tensor, x: Tensor, rule: str) -> Tensor:
    """A fixed-rule helper's half table as ``(n, S, r/2)`` rows, ``n`` 1 or x's batch (``(S, r/2)``
    for an unbatched x): what it holds, whatever singleton axes it carries (Llama 4's vision tower
    hands ``(S, 1, r/2)`` frequencies, which its helper views against the queries). Unchanged where
    its size does not fit."""
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
    """How the kernel reads the tables of a call broadcast by ``rule`` (the helper's probed rule, "param"
    for one taking unsqueeze_dim): "hs" (tokens second to last in ``x``), "sh", "flat" (``(b, s, d)``,
    one head), or None where it cannot. Right-aligned ``(1 or none, S, r/2)`` tables against a 4-D
    ``x`` (SAM 3's "flat" rule) are per-token rows: "hs"."""
    if rule == "param":
        return _unsqueezed_rule(unsqueeze, table.dim())
    if rule == "flat" and x.dim() == 4 and (table.dim() == 2 or (table.dim() == 3 and table.shape[0] == 1)):
        return "hs"
    return rule


def _unsqueezed_rule(unsqueeze: Any, table_dim: int) -> str | None:
    """Where HF's ``cos.unsqueeze(unsqueeze_dim)`` puts the tables' token axis against ``x``: "hs" for
    ``(S, R)`` tables at 0 or ``(B, S, R)`` at 1 (tokens second to last, ``x (B, H, S, D)``), "sh" for
    ``(S, R)`` at 1 or ``(B, S, R)`` at 2 (``x (B, S, H, D)``); None for any other broadcast."""
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
