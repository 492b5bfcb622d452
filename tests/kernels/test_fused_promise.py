"""``fused`` means one thing for every component (``torchembed.kernels.route``): ``None`` the kernel where it runs
and takes the call, PyTorch elsewhere, quietly; ``True`` the kernel for every call the component computes, or
``FusedUnavailableError`` naming why; ``False`` never the kernel.

Each component is checked the same way, with the kernels switched off for the test (``TORCHEMBED_DISABLE_TRITON=1``,
read per call) and on (CUDA, or the CPU under ``TRITON_INTERPRET=1``): the rotation (``RotaryEmbedding``), the ALiBi
attention (``ALiBiEmbedding.attention``) and a patched RoPE model's decode-step attention (``DecodeAttention``)."""

from __future__ import annotations

import pytest
import torch

from torchembed.kernels.route import FusedUnavailableError

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rotation():
    from torchembed.positional import RotaryEmbedding

    q, k = torch.randn(2, 4, 6, 16, device=DEV), torch.randn(2, 2, 6, 16, device=DEV)
    modules = {fused: RotaryEmbedding(16, max_seq_len=32, fused=fused).to(DEV) for fused in (None, True, False)}
    return lambda fused: modules[fused](q, k, offset=3)[0]


def _alibi():
    from torchembed.positional import ALiBiEmbedding

    alibi = ALiBiEmbedding(4).to(DEV)
    q, k, v = (torch.randn(2, 4, 5, 16, device=DEV) for _ in range(3))
    return lambda fused: alibi.attention(q, k, v, fused=fused)


def _decode_attention():
    from torchembed.patches.rope.decode_attention import DecodeAttention

    q = torch.randn(2, 4, 1, 16, device=DEV)
    k, v = torch.randn(2, 2, 30, 16, device=DEV), torch.randn(2, 2, 30, 16, device=DEV)
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool, device=DEV)

    def upstream(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3], device=DEV), None

    return lambda fused: DecodeAttention(upstream, fused)(None, q, k, v, keep)[0]


COMPONENTS = {"rotation": _rotation, "alibi attention": _alibi, "decode attention": _decode_attention}


def _launches(monkeypatch) -> list:
    """Counts the library's kernel launches (every kernel launches through ``launch.Launch``)."""
    from torchembed.kernels.launch import Launch

    calls, original = [], Launch.__call__
    monkeypatch.setattr(Launch, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_fused_true_raises_where_no_kernel_runs_none_falls_back_quietly(component, monkeypatch):
    call = COMPONENTS[component]()
    on_kernel = call(None)
    monkeypatch.setenv("TORCHEMBED_DISABLE_TRITON", "1")
    with pytest.raises(FusedUnavailableError, match="fused=True: .*TORCHEMBED_DISABLE_TRITON=1.*fused=None"):
        call(True)
    quiet = call(None)  # PyTorch, no warning, no error
    torch.testing.assert_close(quiet, call(False))
    if component != "decode attention":  # (upstream's stand-in returns zeros: not the same function)
        torch.testing.assert_close(quiet, on_kernel, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_fused_none_and_true_take_the_kernel_where_it_runs_false_never(component, monkeypatch):
    call = COMPONENTS[component]()
    launches = _launches(monkeypatch)
    for fused, kernel in ((None, True), (True, True), (False, False)):
        launches.clear()
        call(fused)
        assert bool(launches) == kernel, (fused, len(launches))


def test_a_decode_step_the_kernel_cannot_compute_raises_under_true_and_goes_upstream_under_none():
    """The decode attention's ``True`` is the same promise as the others': every decode step on the kernel, or the
    error naming why (a keyword that changes upstream's function here); ``None`` leaves that call to upstream. A
    prefill is not the kernel's call under any ``fused``: upstream's, without an error."""
    from torchembed.patches.rope.decode_attention import DecodeAttention

    seen = []

    def upstream(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        seen.append(query.shape[2])
        return torch.zeros_like(query).transpose(1, 2), None

    q, k = torch.randn(1, 4, 1, 16, device=DEV), torch.randn(1, 2, 30, 16, device=DEV)
    keep = torch.ones(1, 1, 1, 30, dtype=torch.bool, device=DEV)
    with pytest.raises(FusedUnavailableError, match="softcap"):
        DecodeAttention(upstream, True)(None, q, k, k, keep, softcap=30.0)
    DecodeAttention(upstream, None)(None, q, k, k, keep, softcap=30.0)
    assert seen == [1]
    prefill = torch.randn(1, 4, 30, 16, device=DEV)
    DecodeAttention(upstream, True)(None, prefill, k, k, None)
    assert seen == [1, 30]
