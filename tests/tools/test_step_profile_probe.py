"""``benchmarks/probes/decode_step_profile.py``: the step's GPU time summed by kernel kind, the longest kernel names
of each kind kept (what names an unexplained kind on the GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "decode_step_profile.py"


def _load(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBE.parent))  # (it imports its sibling cache_growth)
    spec = importlib.util.spec_from_file_location("decode_step_profile", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name: str, start_us: float, end_us: float, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_kernels_are_summed_by_kind_with_their_longest_names(monkeypatch) -> None:
    probe = _load(monkeypatch)
    assert probe.kernel_kind("flash_fwd_kernel") == "SDPA / flash"  # (also ends in _fwd_kernel: SDPA's first)
    assert probe.kernel_kind("_decode_kernel") == "torchembed attention"
    assert probe.kernel_kind("sm90_xmma_gemm_bf16") == "matmul"
    events = [_event("_decode_kernel", 0, 30), _event("_combine_kernel", 30, 35), _event("_decode_kernel", 40, 70),
              _event("mystery_a", 0, 10), _event("mystery_b", 0, 2), _event("mystery_c", 0, 3),
              _event("mystery_d", 0, 1), _event("mystery_a", 10, 20),
              _event("aten::mm", 0, 500, torch.autograd.DeviceType.CPU)]  # (host events are left out)
    kinds = probe._kernels_by_kind(events)
    assert set(kinds) == {"torchembed attention", "other"}
    attention, other = kinds["torchembed attention"], kinds["other"]
    assert (attention["kernels"], round(attention["ms"], 6)) == (3, 0.065)
    assert attention["names"] == {"_decode_kernel": 0.06, "_combine_kernel": 0.005}
    assert (other["kernels"], round(other["ms"], 6)) == (5, 0.026)
    assert list(other["names"]) == ["mystery_a", "mystery_c", "mystery_b"]  # the three longest, longest first


def _host(name: str, self_us: float, parent=None, stack=()):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, cpu_parent=parent,
                           self_cpu_time_total=self_us, stack=list(stack))


def test_host_time_goes_to_the_nearest_frame_and_is_not_recorded_without_frames(monkeypatch) -> None:
    probe = _load(monkeypatch)
    # the profiler's Python-function events, operators below them
    loop = _host("probe.py(10): main", 100)
    patched = _host("/x/torchembed/patches/rope.py(5): __call__", 20, loop)
    upstream = _host("/usr/lib/transformers/models/llama/modeling_llama.py(9): forward", 30, loop)
    events = [loop, patched, upstream, _host("aten::mul", 7, patched), _host("aten::mm", 11, upstream),
              _host("aten::empty", 1, _host("aten::to", 2, patched))]
    assert probe._host_by_owner(events) == pytest.approx({"torchembed": 0.028, "transformers": 0.041, "other": 0.1})
    # no such events, each operator's own stack instead (innermost frame first)
    events = [_host("aten::mul", 7, stack=["/x/torchembed/patches/rope.py(5): __call__", "probe.py(10): main"]),
              _host("aten::mm", 11, stack=["/t/torch/nn/functional.py(3): linear",
                                           "/t/transformers/models/llama/modeling_llama.py(9): forward"]),
              _host("aten::add", 5, stack=["probe.py(10): main"])]
    assert probe._host_by_owner(events) == pytest.approx({"torchembed": 0.007, "transformers": 0.011, "other": 0.005})
    # neither: every operator would count as "other", which measures nothing
    assert probe._host_by_owner([_host("aten::mul", 7), _host("aten::mm", 11, _host("aten::matmul", 1))]) is None
