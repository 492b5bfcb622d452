"""What moving a long cache into rooms costs (``torchembed.patches.kv_cache.room_for``: the first decode step after a
prefill, and a room grown past its space), for LLaMA-3.1-8B's (8 kv heads at 128k tokens) and BLOOM-7B1's (32 heads at
64k) cache layers, in ms per layer: the library's move (the cache read as 16-byte elements) against one strided copy
of 2-byte elements (how it moved a cache before) and a contiguous copy of the same bytes (the copy bandwidth).

    python benchmarks/probes/room_move.py [--layers 8] [--repeats 5] [--out DIR]

The run in ``benchmarks/results/long-plain-generate-h100.md`` (15:37 UTC) used this probe at commit 190263a, which also
timed a move copying each (batch, head) row as one block (``git show 190263a:benchmarks/probes/room_move.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from torchembed.patches import kv_cache

SHAPES = {"llama-128k": (1, 8, 131072, 128), "bloom-64k": (1, 32, 65536, 128)}


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def strided_move(layers) -> None:
    """The move as one strided copy of 2-byte elements per tensor (and a strided zeroing of the space)."""
    for layer in layers:
        for held in (layer.keys, layer.values):
            buffer = held.new_empty(*held.shape[:-2], held.shape[-2] + max(256, held.shape[-2] // 8), held.shape[-1])
            buffer[..., :held.shape[-2], :].copy_(held)
            buffer[..., held.shape[-2]:, :].zero_()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    records = []
    for name, shape in SHAPES.items():
        layers = []
        for _ in range(args.layers):
            layer = transformers.cache_utils.DynamicLayer()
            layer.update(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                         torch.randn(shape, device="cuda", dtype=torch.bfloat16))
            layers.append(layer)
        nbytes = 2 * layers[0].keys.numel() * layers[0].keys.element_size()  # keys and values of one layer
        scratch = torch.empty_like(layers[0].keys)
        copy_ms = statistics.median(timed_ms(lambda: scratch.copy_(layers[0].keys)) for _ in range(args.repeats)) * 2
        del scratch
        library, strided = [], []
        for _ in range(args.repeats):
            for layer in layers:  # (a fresh move each time: the layer forgets its room)
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
                layer.__dict__.pop("_torchembed_room", None)
            torch.cuda.empty_cache()
            library.append(timed_ms(lambda: [kv_cache.room_for(layer, 1) for layer in layers]) / len(layers))
            torch.cuda.empty_cache()
            strided.append(timed_ms(lambda: strided_move(layers)) / len(layers))
        record = {"shape": name, "kv": list(shape), "gb_per_layer": nbytes / 1e9, "contiguous_copy_ms": copy_ms,
                  "library_ms_per_layer": statistics.median(library), "strided_ms_per_layer": statistics.median(strided)}
        records.append(record)
        print(f"{name}: per layer {nbytes / 1e9:.2f} GB; contiguous copy {copy_ms:.2f} ms; the library's move "
              f"{record['library_ms_per_layer']:.2f} ms; one strided copy of 2-byte elements "
              f"{record['strided_ms_per_layer']:.2f} ms", flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "room-move.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                            "records": records}, indent=1))


if __name__ == "__main__":
    main()
