"""Host time per call of the public fused RoPE entry points at decode shapes.

q ``(B, 32, 1, 128)``, k ``(B, 8, 1, 128)`` in HF's layout (``(B, S, H, D)`` memory viewed as
``(B, H, S, D)``), bf16, B in {1, 32}; every position form of ``RotaryEmbedding(fused=None).forward`` and
``kernels.rotary_fused``, the patched HF helper (torchembed's replacement of LLaMA's
``apply_rotary_pos_emb``, called as HF's attention calls it: in place on the kernel) and upstream's
helper itself. Prints the median over repeats of the mean time of ``--calls`` calls and the best
repeat, in microseconds (the cases interleaved within each repeat).

On a CUDA machine the kernel really launches (the time is the host's: calls are not synchronised),
and two floors under every entry point are timed with them: the kept launch called directly, and
Triton's compiled launcher alone with its arguments made beforehand.
Elsewhere the script runs on CPU under ``TRITON_INTERPRET=1`` with the Triton launch replaced by a
no-op, so it times every host step but the launch itself. CPU tensor positions are checked for
negative values on the host (a tensor op the CUDA path does not make).

    python benchmarks/host_overhead.py [--calls 2000] [--repeats 7]

It imports the ``torchembed`` of this checkout unless ``PYTHONPATH`` is set (then that one's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

if not os.environ.get("PYTHONPATH"):  # this checkout's package unless told otherwise
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchembed import RotaryEmbedding, kernels
from torchembed.kernels import rope_triton
from torchembed.patches.rope.recognition import recognize
from torchembed.patches.rope.helper import RotaryHelper


class _NoLaunch:
    """Stands in for the Triton kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _time_all(cases: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Host time per call of each case, ``(median, best)`` over repeats, in microseconds.

    The cases take turns within each repeat (a burst of noise on the host then touches every case
    alike, not one). On CUDA a repeat's calls run in chunks that the launch queue holds (its depth is
    about a thousand launches), synchronised between chunks and outside the clock, so the time is the
    host's even where the kernels are the slower side."""
    chunk = 250 if CUDA else calls
    for fn in cases.values():
        for _ in range(50):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            elapsed = 0.0
            for done in range(0, calls, chunk):
                if CUDA:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(min(chunk, calls - done)):
                    fn()
                elapsed += time.perf_counter() - start
            samples[name].append(elapsed / calls * 1e6)
    if CUDA:
        torch.cuda.synchronize()
    return {name: (statistics.median(x), min(x)) for name, x in samples.items()}


def _launch_floors(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The floor under every entry point (CUDA only): the kept launch of ``rotary_fused(q, k, cos, sin)``
    called directly (a :class:`torchembed.kernels.launch.Launch`: its pointer reads and the launcher), and
    Triton's compiled launcher alone with every argument an int or float made beforehand (read out of the
    kept launch)."""
    from torchembed.kernels import launch, rope

    rope.clear_launches()
    kernels.rotary_fused(q, k, cos, sin)  # validated, launched and kept
    (key,) = rope.LAUNCHES
    kept = rope.LAUNCHES.get(key)
    tensors = (q, k, q, k, cos, sin, q, q)  # (q, k, q_out, k_out, cos, sin, positions, inv_freq): q for the absent
    out = {"floor: the kept launch alone": lambda: kept(tensors, 0, 1.0)}
    if kept.entry is not None and launch.direct():
        args = (*kept.grid, launch.raw_stream(kept.index), *kept.head, *(t.data_ptr() for t in tensors), *kept.fixed,
                0, 1.0, *kept.tail)
        entry = kept.entry
        out["floor: Triton's launcher alone"] = lambda: entry(*args)
    return out


def _cases(batch: int, device: torch.device) -> dict[str, Callable[[], object]]:
    from transformers.models.llama import modeling_llama

    def hf_layout(heads: int) -> torch.Tensor:  # (B, S, H, D) memory viewed as (B, H, S, D)
        return torch.randn(batch, 1, heads, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)

    q, k = hf_layout(32), hf_layout(8)
    rope = RotaryEmbedding(128, fused=None, device=device)
    inv_freq = rope.inv_freq
    offsets = torch.full((batch,), 1000, device=device, dtype=torch.long)
    ids_s = torch.full((1,), 1000, device=device, dtype=torch.long)
    ids_bs = torch.full((batch, 1), 1000, device=device, dtype=torch.long)
    cos = torch.randn(1, 1, 64, device=device)
    sin = torch.randn(1, 1, 64, device=device)
    upstream = modeling_llama.apply_rotary_pos_emb
    helper = RotaryHelper.get(recognize(upstream), upstream, None)
    cos_hf = torch.cat((cos, cos), -1).to(torch.bfloat16)  # HF's (1, s, D) tables in the activation dtype
    sin_hf = torch.cat((sin, sin), -1).to(torch.bfloat16)
    floors = _launch_floors(q, k, cos, sin) if CUDA else {}
    return {
        **floors,
        "RotaryEmbedding offset=int": lambda: rope(q, k, offset=1000),
        "RotaryEmbedding offset=(b,)": lambda: rope(q, k, offset=offsets),
        "RotaryEmbedding position_ids=(s,)": lambda: rope(q, k, position_ids=ids_s),
        "RotaryEmbedding position_ids=(b,s)": lambda: rope(q, k, position_ids=ids_bs),
        "rotary_fused cos/sin (1,s,r/2)": lambda: kernels.rotary_fused(q, k, cos, sin),
        "rotary_fused inv_freq positions=int": lambda: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=1000),
        "rotary_fused inv_freq positions=(b,)": lambda: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=offsets),
        "rotary_fused inv_freq positions=(b,s)": lambda: kernels.rotary_fused(q, k, inv_freq=inv_freq, positions=ids_bs),
        "patched HF helper (q, k, cos, sin) [in place]": lambda: helper(q, k, cos_hf, sin_hf),
        "upstream HF apply_rotary_pos_emb": lambda: upstream(q, k, cos_hf, sin_hf),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median and best are printed)")
    parser.add_argument("--json", help="also write the table to this JSON file")
    args = parser.parse_args()
    device = torch.device("cuda" if CUDA else "cpu")
    if not CUDA:
        rope_triton.rope_kernel = _NoLaunch()
    mode = torch.cuda.get_device_name() if CUDA else "CPU, TRITON_INTERPRET=1, launch stubbed"
    print(f"host us/call ({mode}; median and best of {args.repeats} x {args.calls} calls, cases interleaved)")
    results = {batch: _time_all(_cases(batch, device), args.calls, args.repeats) for batch in (1, 32)}
    width = max(len(name) for name in results[1])
    print(f"{'entry point':<{width}}  {'B=1':>7}  {'best':>6}  {'B=32':>7}  {'best':>6}")
    for name in results[1]:
        (m1, b1), (m32, b32) = results[1][name], results[32][name]
        print(f"{name:<{width}}  {m1:7.1f}  {b1:6.1f}  {m32:7.1f}  {b32:6.1f}")
    if args.json:
        import json
        import platform

        import triton

        meta = dict(device=mode, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                    shape="q (B, 32, 1, 128), k (B, 8, 1, 128), bf16", calls=args.calls, repeats=args.repeats,
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        rows = [dict(entry_point=name, us_b1=results[1][name][0], us_b32=results[32][name][0],
                     best_us_b1=results[1][name][1], best_us_b32=results[32][name][1]) for name in results[1]]
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=rows), indent=1))


if __name__ == "__main__":
    with torch.inference_mode(False), torch.no_grad():
        main()
