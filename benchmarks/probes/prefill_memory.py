"""Peak device memory of one long prefill of a patched model and of the first decode step after it: the library's
cache (the prefill concatenated as upstream does, moved into buffers with room to grow at the first decode step)
against a variant tried and dropped, the prefill written straight into buffers with 1/64 more space. An
out-of-memory is printed with the allocator's own message (the size it tried, what was reserved but unallocated).

    python benchmarks/probes/prefill_memory.py --models bloom mpt --context 65536 --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from torchembed.patches import kv_cache
from torchembed.tools.bench_long import make_config

LAYERS = {"bloom": 30, "mpt": 32, "falcon": 32, "llama": 32}


def _into_room(cache, k, v, layer_idx, *args, strided_copy=False, **kwargs):
    """The dropped variant of ``kv_cache.update``: a long first update goes into buffers with 1/64 more space."""
    layer = kv_cache.growing_layer(cache, layer_idx)
    if layer is kv_cache.EMPTY and k.numel() * k.element_size() >= kv_cache.IN_PLACE_BYTES:
        cache.update(k[..., :0, :], v[..., :0, :], layer_idx, *args, **kwargs)  # (makes the layer, no tokens)
        layer = cache.layers[layer_idx]
        size = k.shape[-2] + max(256, k.shape[-2] // 64)
        room = tuple(t.new_zeros(*t.shape[:-2], size, t.shape[-1]) for t in (k, v))
        room[0][..., :k.shape[-2], :].copy_(k)
        room[1][..., :k.shape[-2], :].copy_(v)
        layer.__dict__[kv_cache._ROOM] = room
        layer.keys, layer.values = room[0][..., :k.shape[-2], :], room[1][..., :k.shape[-2], :]
        return layer.keys, layer.values
    return _update(cache, k, v, layer_idx, *args, strided_copy=strided_copy, **kwargs)


_update = kv_cache.update


def measure(model, vocab: int, context: int, room: bool) -> dict:
    if room:
        kv_cache.update = _into_room
    record = {"room_at_prefill": room}
    try:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ids = torch.randint(3, vocab - 16, (1, context), device="cuda")
        with torch.no_grad():
            out = model.base_model(input_ids=ids, use_cache=True)
            torch.cuda.synchronize()
            record["prefill_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            record["after_prefill_gb"] = (torch.cuda.memory_allocated() - base) / 2**30
            record["reserved_gb"] = torch.cuda.memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
            model.base_model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
            torch.cuda.synchronize()
            record["first_step_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    except torch.OutOfMemoryError as exc:
        record["oom"] = str(exc).split("\n")[0][:400]
        record["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    finally:
        kv_cache.update = _update
        out = ids = None
        gc.collect()
        torch.cuda.empty_cache()
    return record


def main(argv: list[str]) -> int:
    import transformers

    import torchembed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bloom", "mpt"])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        config = make_config(name, LAYERS[name], args.context, False)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        torchembed.patch(model)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        for room in (False, True, False, True):
            rec = {"model": name, "context": args.context, "weights_gb": weights, **measure(
                model, config.get_text_config().vocab_size, args.context, room)}
            print(json.dumps(rec), flush=True)
            results.append(rec)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill-memory.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                               "transformers": transformers.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
