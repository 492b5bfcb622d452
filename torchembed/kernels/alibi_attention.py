"""ALiBi attention for prefill: fused kernels at scale, nothing quadratic materialised there.

Press et al., arXiv:2108.12409. Small CUDA prefills (at most ``DENSE_MAX_ELEMENTS`` bias elements)
take SDPA with the ``(b, h, q, k)`` bias materialised once per forward (faster there; written in one
Triton pass, :mod:`torchembed.kernels.alibi_bias`); larger ones one of two fused paths:

* **bias columns + SDPA** (causal prefill without padding, bf16/float32): the key-only bias is
  carried by extra head-dim columns, ``q' = [q, 1, 1, 1, -r_i]`` and ``k' = [k, b_j]`` with
  ``b_j = key_bias[j] / scale`` split into three bf16 parts (float32 accuracy) and ``r_i`` the
  query's own ``b`` (a per-row constant, which softmax ignores, keeping the sums small), padded to
  ``d + 8`` (``v`` is unchanged). Then ``scale * q'.k' = scale * q.k + key_bias[j] - key_bias[i]``,
  and ``scaled_dot_product_attention(..., is_causal=True)`` runs its cuDNN (or memory-efficient)
  kernel: no bias, score or mask tensor, one fused kernel. On the H200 it is 2x faster than
  FlexAttention at 8k-16k tokens and spares the block mask's construction at every length.
* **FlexAttention** (any mask: left padding, KV cache, static-cache slots): ``flex_attention``
  with an ALiBi ``score_mod`` and a block mask derived once per forward, which skips the masked
  blocks.

Decode steps (``q = 1``), CPU tensors and ``torch.compile`` regions take SDPA with a bias
(:func:`torchembed.functional.alibi.alibi_attention_reference`, whose decode mask is ``(b, h, 1, k)``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchembed.functional.alibi import alibi_attention_reference, alibi_decode_bias
from torchembed.kernels.alibi_bias import prefill_bias
from torchembed.kernels.alibi_flash import attempt, flash_unsupported, mask_rows
from torchembed.kernels.availability import FusedUnavailableError, use_kernel

__all__ = ["alibi_attention", "flex_available", "alibi_score_mod", "bias_columns", "causal_keep", "dense_prefill", "prefill_path",
           "MaskCache"]


_CAUSAL: dict = {}
# Devices whose prefill takes the fused paths (tests add "cpu" to exercise them).
_FUSED_DEVICES: tuple[str, ...] = ("cuda",)
# "auto": a materialised bias for small prefills, else bias columns + SDPA where they apply and
# FlexAttention elsewhere; "flex": FlexAttention only; "dense": the materialised bias only.
PREFILL_PATHS = ("auto", "flex", "dense")
# "auto" materialises the (b, h, q, k) bias (once per forward, then SDPA with a mask, as upstream's sdpa
# attention does) up to this many elements (128 MB in bf16): there it measured faster than the bias
# columns (which copy q and k per layer and build the columns per forward) on the H200, per layer and
# per model forward (benchmarks/results/alibi-paths.md, alibi.md); beyond it the fused paths win and
# the bias would cost memory quadratic in the length.
DENSE_MAX_ELEMENTS = 2**26
_PREFILL = os.environ.get("TORCHEMBED_ALIBI_PREFILL", "auto")
if _PREFILL not in PREFILL_PATHS:
    raise ValueError(f"TORCHEMBED_ALIBI_PREFILL must be one of {PREFILL_PATHS}, got {_PREFILL!r}")
_CHECK_ELEMENTS = 2**24  # mask elements compared per block when checking for a plain causal mask
_CACHED_CAUSAL_ELEMENTS = 2**22  # up to 2048 x 2048 the check compares with a cached causal mask (4 MB)
COLUMNS = 8  # extra head-dim columns of the bias-columns path (5 used; a multiple of 8 keeps alignment)
# Dynamo compiles flex_attention once per distinct (shapes, strides, dtype, heads) guard set and
# counts them per function: past its default of 8 it silently runs flex_attention unfused, which
# materialises the scores. One process serving several ALiBi models, batch sizes and layouts needs
# more, so the limit is raised around torchembed's calls (and restored after each).
_RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def flex_available() -> bool:
    """FlexAttention importable and not disabled (``TORCHEMBED_DISABLE_FLEX=1``)."""
    if os.environ.get("TORCHEMBED_DISABLE_FLEX", "0") == "1":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiled():
    """``flex_attention`` and ``create_block_mask``, each compiled once. (``create_block_mask(...,
    _compile=True)`` wraps itself in a fresh ``torch.compile`` on every call, which costs ~5 ms of
    host time per call: more than the attention of a 2048-token prefill.)"""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), torch.compile(create_block_mask)


@contextlib.contextmanager
def prefill_path(path: str):
    """Within the block, CUDA prefill takes ``path``: ``"auto"`` (the default: the materialised bias
    up to ``DENSE_MAX_ELEMENTS``, else bias columns + SDPA where they apply and FlexAttention
    elsewhere), ``"flex"`` (FlexAttention only) or ``"dense"`` (the materialised bias only), e.g. to
    measure one against another. The process-wide default comes from ``TORCHEMBED_ALIBI_PREFILL``.

    Raises:
        ValueError: an unknown path.
    """
    global _PREFILL
    if path not in PREFILL_PATHS:
        raise ValueError(f"prefill path must be one of {PREFILL_PATHS}, got {path!r}")
    previous, _PREFILL = _PREFILL, path
    try:
        yield
    finally:
        _PREFILL = previous


def prefill_path_is_auto() -> bool:
    """No :func:`prefill_path` other than ``"auto"`` is in force."""
    return _PREFILL == "auto"


@contextlib.contextmanager
def _recompile_limit():
    """Raise dynamo's recompile limit to at least ``_RECOMPILE_LIMIT`` (restored on exit)."""
    config = torch._dynamo.config
    limit = config.recompile_limit
    config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
    try:
        yield
    finally:
        config.recompile_limit = limit


def alibi_score_mod(key_bias: Tensor):
    """A FlexAttention ``score_mod`` adding ``key_bias[b, h, kv]`` (``(b or 1, h, k)`` float32)."""
    if key_bias.shape[0] == 1:  # (an int index among the index tensors fails under vmap on torch < 2.9)
        shared = key_bias[0]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + shared[h, kv_idx]
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + key_bias[b, h, kv_idx]

    return score_mod


def _causal(q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, "MaskCache"]:
    """The causal ``keep`` mask (queries last) and its cache slot, shared by all layers."""
    key = (q_len, k_len, device)
    entry = _CAUSAL.get(key)
    if entry is None:
        if len(_CAUSAL) >= 8:
            _CAUSAL.clear()
        entry = MaskCache()
        entry.keep = _causal_rows(k_len - q_len, k_len, k_len, device)[None, None]
        _CAUSAL[key] = entry
    return entry.keep, entry


def _causal_rows(first: int, stop: int, k_len: int, device: torch.device) -> Tensor:
    """Rows ``first .. stop - 1`` (absolute query positions) of the causal mask over ``k_len``
    keys: ``(rows, k)`` bool."""
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(first, stop, device=device)[:, None]


class MaskCache:
    """The ``keep`` mask and FlexAttention block mask derived from one HF mask tensor, and
    (:meth:`memo`) what else a forward derives once for all its layers.

    HF passes the same attention-mask tensor to every layer of a forward; deriving the boolean
    mask and the block mask (which evaluates the mask over all blocks) once per forward instead
    of once per layer matters at long sequences. Keyed by the identity of the source tensor
    through a weak reference, so a new forward (a new mask tensor) always recomputes.
    """

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self.keep: Tensor | None = None
        self.block_mask = None
        self._memo: dict = {}

    def alive(self) -> bool:
        """The source tensor still exists (its forward may still be running)."""
        return self._source is not None and self._source() is not None

    def lookup(self, source: Tensor) -> "MaskCache | None":
        return self if self._source is not None and self._source() is source else None

    def store(self, source: Tensor, keep: Tensor | None) -> "MaskCache":
        # When the source mask dies (the forward is over), drop what was derived from it.
        self._source, self.keep, self.block_mask = weakref.ref(source, self._clear), keep, None
        self._memo = {}
        return self

    def memo(self, source: Tensor, tag: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` computed once per ``(source, tag)`` while this mask lives: per-forward
        derivations of tensors every layer receives (the ALiBi bias), shared by the layers.
        ``source`` is held weakly and checked by identity, so a new tensor never hits an old entry."""
        entry = self._memo.get((id(source), tag))
        if entry is not None and entry[0]() is source:
            return entry[1]
        value = make()
        self._memo = {key: e for key, e in self._memo.items() if e[0]() is not None}  # drop dead sources
        self._memo[(id(source), tag)] = (weakref.ref(source), value)
        return value

    def _clear(self, ref: weakref.ref) -> None:
        if ref is self._source:
            self._source, self.keep, self.block_mask, self._memo = None, None, None, {}


def alibi_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor | None = None,
    keep: Tensor | None = None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    cache: MaskCache | None = None,
    fused: bool | None = None,
    slopes: Tensor | None = None,
) -> Tensor:
    """Attention with ALiBi: ``softmax(scale * q k^T + bias | keep) v``.

    The bias is ``key_bias[b, h, j]`` (a key-only form, as the HF ALiBi models build it) or, given
    ``slopes``, ``slope_h * (j - i)``; either up to a constant per query row, which softmax ignores.

    Args:
        q: ``(b, h, q, d)``; k, v: ``(b, hk, k, d)``, ``h`` a multiple of ``hk`` (GQA/MQA).
        key_bias: ``(b or 1, h, k)``, any float dtype (used in float32); or None with ``slopes``.
        keep: ``(b or 1, 1, q, k)`` bool, True where a query may attend (HF's causal + padding
            mask, static-cache slots included). None: causal, queries at the last positions.
        scale: multiplies ``q k^T``.
        dropout_p: attention dropout (the fused kernel has none: it runs the PyTorch path).
        cache: where what is derived from ``keep`` and ``key_bias`` (the kernel's row summary of the
            mask, ...) is kept across the layers of one forward; pass the same ``key_bias`` tensor
            to every layer, e.g. via ``cache.memo``.
        fused: None: the fused kernel (:func:`torchembed.kernels.alibi_flash.alibi_flash`) where it
            runs, PyTorch elsewhere; True: the kernel or :class:`FusedUnavailableError`; False:
            PyTorch operations only (SDPA with the materialised bias).
        slopes: ``(h,)`` per-head slopes, instead of ``key_bias``.

    Returns:
        ``(b, h, q, d)`` in ``q.dtype``. A query row that keeps no key: 0 from the kernel, the mean of
        ``v`` (upstream's eager behaviour) from the PyTorch path.

    Raises:
        FusedUnavailableError: ``fused=True`` where the kernel cannot run, naming why.
        ValueError: neither ``key_bias`` nor ``slopes``.
    """
    if key_bias is None and slopes is None:
        raise ValueError("alibi_attention needs key_bias (b or 1, h, k) or slopes (h,)")
    if fused is not False and (fused or _PREFILL == "auto"):  # (prefill_path("flex"/"dense"): those paths)
        why = "it has no dropout (dropout_p > 0)"
        if not dropout_p and use_kernel(fused, q, "the fused ALiBi attention kernel"):
            out = _flash(q, k, v, key_bias, slopes, keep, scale, cache)
            if not isinstance(out, str):
                return out
            why = out
        if fused:
            raise FusedUnavailableError(f"fused=True: the fused ALiBi attention kernel cannot take these inputs: {why}; "
                                        "pass fused=None to run PyTorch's attention there")
    if key_bias is None:  # slope * (j - (k - 1)): zero at the newest key, small near it
        positions = torch.arange(1 - k.shape[-2], 1, device=q.device, dtype=torch.float32)
        key_bias = slopes.to(q.device, torch.float32)[None, :, None] * positions
    heads = q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    if fused is False:  # PyTorch operations only
        if keep is None and q.shape[-2] > 1:
            keep = causal_keep(q.shape[-2], k.shape[-2], q.device)
        return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)
    return _unfused(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p, cache=cache)


def _flash(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None, slopes: Tensor | None, keep: Tensor | None,
           scale: float, cache: MaskCache | None) -> Tensor | str:
    """The fused kernel, or why it does not take these inputs; the mask's row summary derived once
    per mask tensor (``cache``)."""
    rows = None
    if keep is not None:
        if flash_unsupported(q, k, v, keep) is not None:  # (before summarising a mask it cannot use)
            return flash_unsupported(q, k, v, keep)
        rows = mask_rows(keep) if cache is None else cache.memo(keep, "rows", lambda: mask_rows(keep))
    if slopes is not None:
        return attempt(q, k, v, slopes, scale=scale, keep=keep, rows=rows)
    return attempt(q, k, v, key_bias, scale=scale, key_bias=True, keep=keep, rows=rows)


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    """``(b, hk, s, d) -> (b, heads, s, d)`` for the paths that need one kv head per query head (a
    stride-0 view for one kv head)."""
    batch, kv, length, dim = x.shape
    if kv == heads:
        return x
    if kv == 1:
        return x.expand(batch, heads, length, dim)
    if heads % kv:
        raise ValueError(f"{heads} query heads are not a multiple of {kv} key/value heads")
    return x[:, :, None].expand(batch, kv, heads // kv, length, dim).reshape(batch, heads, length, dim)


def _unfused(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, keep: Tensor | None, *, scale: float,
             dropout_p: float, cache: MaskCache | None) -> Tensor:
    """Where the fused kernel does not run: SDPA with the materialised bias, the bias columns or
    FlexAttention on CUDA prefill, SDPA with a bias elsewhere."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    if dense_prefill(q, k):
        if keep is None:
            keep, cache = _causal(q_len, k_len, q.device)
        make = lambda: prefill_bias(key_bias, keep, q.dtype)  # noqa: E731
        bias = make() if cache is None else cache.memo(key_bias, ("dense", q.dtype), make)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    fused = q_len > 1 and q.device.type in _FUSED_DEVICES and not torch.compiler.is_compiling()
    if fused and _columns_apply(q, k, key_bias) and _plain_causal(keep, cache):
        batch = q.shape[0]

        def make() -> tuple[Tensor, Tensor]:  # batch-sized (views), so each layer only concatenates
            return tuple(c.expand(batch, -1, -1, -1) for c in bias_columns(key_bias, q_len, scale, q.dtype))

        tag = ("columns", q.dtype, batch, q_len, scale)
        q_cols, k_cols = make() if cache is None else cache.memo(key_bias, tag, make)
        return _sdpa_with_columns(q, k, v, q_cols, k_cols, scale=scale, dropout_p=dropout_p)
    if keep is None and q_len > 1:
        keep, cache = _causal(q_len, k_len, q.device)
    if fused and dropout_p == 0.0 and q.shape[-1] >= 16 and flex_available():
        return _flex_attention(q, k, v, key_bias, keep, scale=scale, cache=cache)
    if q_len == 1 and cache is not None:  # decode: the mask is the same for every layer
        bias = cache.memo(key_bias, ("decode", q.dtype), lambda: alibi_decode_bias(key_bias, keep, q.dtype))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return alibi_attention_reference(q, k, v, key_bias, keep, scale=scale, dropout_p=dropout_p)


def dense_prefill(q: Tensor, k: Tensor) -> bool:
    """Whether the prefill of ``q (b, h, q, d)`` over ``k (b, h, k, d)`` takes SDPA with the
    materialised bias (:func:`torchembed.kernels.alibi_bias.prefill_bias`, one Triton write): a CUDA
    prefill (outside ``torch.compile``) of at most ``DENSE_MAX_ELEMENTS`` bias elements, or any under
    ``prefill_path("dense")``."""
    q_len = q.shape[-2]
    if q_len == 1 or q.device.type not in _FUSED_DEVICES or torch.compiler.is_compiling():
        return False
    return _PREFILL == "dense" or (_PREFILL == "auto" and q.shape[0] * q.shape[1] * q_len * k.shape[-2] <= DENSE_MAX_ELEMENTS)


def causal_keep(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """The causal ``keep`` mask, queries at the last ``q_len`` of ``k_len`` positions:
    ``(1, 1, q, k)`` bool, shared (do not modify)."""
    return _causal(q_len, k_len, device)[0]


def bias_columns(key_bias: Tensor, q_len: int, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The extra q and k columns that carry a key-only bias through a plain attention kernel.

    With ``b = key_bias / scale`` (float32) split into ``hi + mid + lo`` in ``dtype`` and ``r_i``
    the ``b`` of query ``i``'s own position (queries are the last ``q_len`` keys), in two parts
    ``r_hi + r_lo`` (its own ``hi + mid``):
    ``q_cols[i] = [1, 1, 1, -r_hi, -r_lo, 0, 0, 0]``, ``k_cols[j] = [hi, mid, lo, 1, 1, 0, 0, 0]``,
    so ``scale * q_cols[i] . k_cols[j] = key_bias[j] - key_bias[i]`` to float32 accuracy; the
    per-row constant does not change softmax and keeps the sums near the diagonal small.

    Args:
        key_bias: ``(b or 1, h, k)`` float.
        q_len: number of queries (``<= k``).

    Returns:
        ``(q_cols (b or 1, h, q, 8), k_cols (b or 1, h, k, 8))`` in ``dtype``.
    """
    b = key_bias.float() / scale  # .float() is a no-op for float32 biases
    hi, mid, lo = _split(b, dtype, 3)
    # r's two parts are the queries' own hi and mid (what splitting r again would give)
    queries = slice(b.shape[-1] - q_len, None)
    minus_r_hi, minus_r_lo = -hi[..., queries], -mid[..., queries]
    one_k, zero_k = torch.ones_like(hi), torch.zeros_like(hi)
    one_q, zero_q = torch.ones_like(minus_r_hi), torch.zeros_like(minus_r_hi)
    k_cols = torch.stack([hi, mid, lo, one_k, one_k, zero_k, zero_k, zero_k], dim=-1)
    q_cols = torch.stack([one_q, one_q, one_q, minus_r_hi, minus_r_lo, zero_q, zero_q, zero_q], dim=-1)
    return q_cols, k_cols


def _split(x: Tensor, dtype: torch.dtype, parts: int) -> list[Tensor]:
    """float32 ``x`` as ``parts`` tensors in ``dtype`` whose float32 sum is ``x`` (to float32 accuracy)."""
    out = [x.to(dtype)]
    for _ in range(parts - 1):
        x = x - out[-1]  # float32 (type promotion): what the parts so far miss
        out.append(x.to(dtype))
    return out


def _columns_apply(q: Tensor, k: Tensor, key_bias: Tensor) -> bool:
    """The bias-columns path fits: self-attention prefill (``q = k``; SDPA's ``is_causal`` is
    top-left aligned), bf16/float32 (fp16 cannot hold ``key_bias / scale`` at long lengths), as
    many k heads as q heads and bias heads, ``d + 8`` within the flash/cuDNN head-dim limit."""
    return (
        _PREFILL == "auto"
        and q.shape[-2] == k.shape[-2]
        and q.dtype in (torch.bfloat16, torch.float32)
        and q.shape[1] == k.shape[1] == key_bias.shape[1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] + COLUMNS <= 256
    )


def _plain_causal(keep: Tensor | None, cache: MaskCache | None) -> bool:
    """``keep`` is the causal mask (queries last) and nothing more: no padding, nothing else masked.
    Checked once per mask tensor with one host sync: against a cached causal mask up to
    ``_CACHED_CAUSAL_ELEMENTS``, beyond in row blocks of ~``_CHECK_ELEMENTS`` (no long causal mask is
    allocated whole or kept)."""
    if keep is None:
        return True

    def check() -> bool:
        q_len, k_len = keep.shape[-2:]
        if q_len * k_len <= _CACHED_CAUSAL_ELEMENTS:  # short: against the cached causal mask, 2 launches
            return torch.equal(keep, _causal(q_len, k_len, keep.device)[0].expand_as(keep))
        step, first = max(1, _CHECK_ELEMENTS // k_len), k_len - q_len
        differs = [
            (keep[..., i : i + step, :] != _causal_rows(first + i, first + min(i + step, q_len), k_len, keep.device))
            .any() for i in range(0, q_len, step)
        ]
        return not bool(torch.stack(differs).any())

    return check() if cache is None else cache.memo(keep, "plain-causal", check)


def _sdpa_with_columns(q: Tensor, k: Tensor, v: Tensor, q_cols: Tensor, k_cols: Tensor, *, scale: float,
                       dropout_p: float) -> Tensor:
    """Causal SDPA of ``[q, q_cols]``, ``[k, k_cols]`` (columns batch-sized) and ``v`` (``v`` keeps
    its head dim: the cuDNN and memory-efficient kernels take ``d_v != d_qk``)."""
    q, k = _with_columns(q, q_cols), _with_columns(k, k_cols)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)


def _with_columns(x: Tensor, columns: Tensor) -> Tensor:
    """``cat([x, columns], -1)`` as two copies into a new contiguous tensor: ``x`` is a strided view of
    the fused qkv projection, which ``torch.cat`` copies at a third of the speed (0.22 vs 0.13 ms for
    ``(4, 16, 8192, 64)`` bf16 on an H200)."""
    d = x.shape[-1]
    out = x.new_empty(x.shape[:-1] + (d + columns.shape[-1],))
    out[..., :d].copy_(x)
    out[..., d:].copy_(columns)
    return out


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, keep: Tensor, *, scale: float,
                    cache: MaskCache | None) -> Tensor:
    """FlexAttention with the ALiBi ``score_mod`` and the block mask of ``keep`` (cached on ``cache``)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    flex, create_block_mask = _compiled()
    block_mask = cache.block_mask if cache is not None else None
    if block_mask is None:
        batch_keep = keep.shape[0] != 1
        rows = keep[:, 0] if batch_keep else keep[0, 0]  # views: no int index among the index tensors (torch < 2.9)

        def mask_mod(b, h, q_idx, kv_idx):
            return rows[b, q_idx, kv_idx] if batch_keep else rows[q_idx, kv_idx]

        batch = keep.shape[0] if batch_keep else None
        with _recompile_limit():
            block_mask = create_block_mask(mask_mod, batch, None, q_len, k_len, device=q.device)
        if cache is not None:
            cache.block_mask = block_mask
    # key_bias always batch-sized (a stride-0 view when shared), so every call traces the same
    # score_mod: a broadcast flag in its closure would be one more guard and recompile
    score_mod = alibi_score_mod(key_bias.float().expand(q.shape[0], -1, -1))
    with _recompile_limit():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
