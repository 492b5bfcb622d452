"""Train a tiny (patched) HF model for a few steps, single-process or data-parallel.

    OUT=$(mktemp -d)
    python scripts/train_distributed.py --model llama --patch before --out $OUT/single
    python -m torch.distributed.run --nproc_per_node=2 scripts/train_distributed.py \\
        --model llama --patch before --out $OUT/ddp

Built for checking that torchembed-patched models train identically under DDP/FSDP
(``accelerate.Accelerator().prepare(model, optimizer)``; gloo on CPU, nccl on CUDA):

* model: ``tiny_config(--model)`` (hidden 64, 2 layers, vocab 128), random weights from ``--seed``,
  float32, every dropout off, ``use_cache=False``;
* data: each step draws ``--global-batch`` x ``--seq-len`` token ids from a generator seeded with
  ``--seed``; rank r of N trains on rows ``[r*B/N, (r+1)*B/N)``, so N processes see exactly the
  global batch one process sees (labels = inputs; every sequence has the same number of tokens,
  so the mean of the per-rank mean losses is the global mean loss, and DDP's gradient average is
  the single-process gradient up to float32 summation order);
* AdamW at a fixed learning rate; deterministic algorithms on.

``--size 1b --dtype bfloat16`` trains the ~1B-parameter LLaMA/Falcon configs of ``torchembed bench
e2e`` instead (pure bf16: parameters, gradients, AdamW states) for throughput: the record then holds
each step's wall time (``step_ms``, device synchronised, the first ``--warmup`` steps excluded) and
``tokens_per_s`` over all processes.

``--patch before`` patches the plain model before ``prepare``; ``--patch after`` patches
``accelerator.unwrap_model(model)`` after it. ``--fsdp`` uses accelerate's FSDP plugin (FSDP2,
one unit per decoder layer); where accelerate does not run FSDP (CPU/gloo, or one process) it
says why and exits 3 (accelerate would otherwise fall back to DDP without a word).
``--cpu`` keeps a CUDA machine on CPU/gloo (what the tests use).
``--out DIR``: rank 0 writes the final full state dict to ``DIR/params.safetensors`` and the per-step
global losses (plus the run's settings) to ``DIR/params.json``, and says where; ``--out FILE`` (a name
with a suffix) writes FILE (safetensors when it ends in ``.safetensors``, else ``torch.save``) and FILE
with the suffix ``.json``. Without ``--out`` nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "--cpu" in sys.argv[1:]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything below reaches the CUDA driver (hide_gpus says why)

import torch
from torch import nn

from torchembed import kernels

from torchembed.tools import bench
from torchembed.tools.bench_train import checkpointing_on
from torchembed.tools.launch import hide_gpus

MODELS = ("llama", "falcon", "bloom", "gpt2")
SIZES = {"tiny": MODELS, "1b": ("llama", "falcon")}  # sizes and the models each offers
ROPE_MODELS = ("llama", "falcon")  # patched, these rotate q/k with the Triton kernel where it runs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATCH = ("none", "before", "after")
FSDP_UNSUPPORTED = 3  # exit code: FSDP cannot run here

# Objects that must not be freed before the process exits. Freeing a DDP model frees its Reducer,
# whose destructor runs ~ProcessGroupGloo with the GIL held; that joins gloo's worker threads, and a
# worker finishing a collective may be waiting for the GIL to release a tensor's Python object:
# a deadlock (pytorch/pytorch#56297; here ~1 two-process run in 15 hung when main() returned).
# The script therefore keeps them alive and leaves through os._exit, which runs no destructors.
_KEEP_UNTIL_EXIT: list[Any] = []


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_distributed.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=MODELS, help="tiny config (torchembed.tools.checkpoints)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all processes")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="tiny", choices=tuple(SIZES), help="tiny test config or ~1B (llama/falcon)")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="parameters, gradients, optimizer")
    parser.add_argument("--warmup", type=int, default=0, help="first steps left out of step_ms / tokens_per_s")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--patch", default="before", choices=PATCH, help="torchembed.patch before/after prepare, or not")
    parser.add_argument("--fsdp", action="store_true", help="accelerate's FSDP plugin (FSDP2) instead of DDP")
    parser.add_argument("--grad-checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    parser.add_argument("--cpu", action="store_true", help="CPU and gloo even where CUDA is available")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR|FILE",
                        help="rank 0 writes DIR/params.safetensors and DIR/params.json (losses); or FILE and FILE.json")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.global_batch < 1 or args.seq_len < 2 or not args.lr > 0:
        raise ValueError("--steps and --global-batch must be >= 1, --seq-len >= 2, --lr > 0")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.model not in SIZES[args.size]:
        raise ValueError(f"--size {args.size} offers {', '.join(SIZES[args.size])}, not {args.model!r}")
    if args.out is not None and args.out.suffix == ".json":
        raise ValueError("--out names a folder or the parameter file (e.g. run.safetensors); the losses go next to "
                         "the parameters as .json")
    if args.out is not None and (args.out.is_dir() or not args.out.suffix):  # a folder: both files inside it
        args.out = args.out / "params.safetensors"
    return args


def build_model(name: str, seq_len: int, seed: int, size: str = "tiny",
                dtype: torch.dtype = torch.float32, cpu: bool = False) -> nn.Module:
    """The causal LM ``name`` (``size`` tiny or 1b) in ``dtype``, seeded, dropout off, no KV cache,
    train mode."""
    import transformers

    from torchembed.tools.bench_e2e import make_config
    from torchembed.tools.checkpoints import tiny_config

    transformers.logging.set_verbosity_error()
    config = tiny_config(name) if size == "tiny" else make_config(name, False, seq_len + 8)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    limit = getattr(config, "max_position_embeddings", None)
    if name == "gpt2" and seq_len > limit:  # learned positions: no table rows past the limit
        raise ValueError(f"--seq-len {seq_len} exceeds {name}'s {limit} positions")
    torch.manual_seed(seed)
    # ~1B: initialise on this process's GPU (seconds instead of a minute on the CPU); every rank
    # draws the same weights from the same seed. Tiny: on the CPU, as the parity tests expect.
    on_gpu = size != "tiny" and torch.cuda.is_available() and not cpu
    init = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.manual_seed_all(seed)
    with init:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


def make_accelerator(fsdp: bool, model: nn.Module, cpu: bool) -> Any:
    """An ``Accelerator`` (CPU/gloo with ``cpu`` or without CUDA); with ``fsdp``, accelerate's FSDP2
    plugin, one unit per decoder layer (``model._no_split_modules``)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = None
    if fsdp:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(model._no_split_modules or []), reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False)
    return Accelerator(cpu=cpu or not torch.cuda.is_available(), fsdp_plugin=plugin)


def fsdp_unsupported(accelerator: Any) -> str | None:
    """Why accelerate is not running FSDP in this run (``None`` when it is): it ignores the plugin
    outside multi-process accelerator-device runs and would silently train with DDP instead."""
    import accelerate
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return None
    backend = getattr(accelerator.state, "backend", None)
    where = f"{accelerator.distributed_type.value} on {accelerator.device.type}" + (f" (backend {backend})" if backend
                                                                                    else "")
    why = ("it needs several processes (torchrun)" if accelerator.num_processes == 1 else
           "it enables FSDP only on accelerator devices (CUDA/XPU/NPU/...), not on CPU/gloo")
    return (f"FSDP unsupported here: accelerate {accelerate.__version__} ran this as {where} and ignored the FSDP "
            f"plugin: {why}; training would silently fall back to DDP")


def batches(steps: int, global_batch: int, seq_len: int, vocab: int, seed: int, rank: int,
            world: int) -> list[torch.Tensor]:
    """This rank's share of each step's global batch (identical global batches for any ``world``)."""
    if global_batch % world:
        raise ValueError(f"--global-batch {global_batch} is not divisible by the {world} processes")
    local = global_batch // world
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
        out.append(ids[rank * local:(rank + 1) * local])
    return out


def save(path: Path, state: dict[str, torch.Tensor], record: dict[str, Any]) -> None:
    """Parameters to ``path`` (safetensors or torch), ``record`` to ``path.with_suffix('.json')``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}  # unties shared weights
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)
    path.with_suffix(".json").write_text(json.dumps(record, indent=1))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.cpu:
        hide_gpus()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    import torchembed

    model = build_model(args.model, args.seq_len, args.seed, args.size, DTYPES[args.dtype], args.cpu)
    if args.grad_checkpointing:
        checkpointing_on(model)
    accelerator = make_accelerator(args.fsdp, model, args.cpu)
    if args.fsdp and (why := fsdp_unsupported(accelerator)) is not None:
        accelerator.print(why, file=sys.stderr, flush=True)
        accelerator.end_training()
        return FSDP_UNSUPPORTED
    data = batches(args.steps, args.global_batch, args.seq_len, model.config.vocab_size, args.seed,
                   accelerator.process_index, accelerator.num_processes)
    if args.patch == "before":
        torchembed.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.patch == "after":
        torchembed.patch(accelerator.unwrap_model(model))
    patched = torchembed.is_patched(accelerator.unwrap_model(model))

    losses, step_ms = [], []
    sync = torch.cuda.synchronize if accelerator.device.type == "cuda" else (lambda: None)
    for step, ids in enumerate(data):
        sync()
        start = time.perf_counter()
        ids = ids.to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        step_ms.append((time.perf_counter() - start) * 1e3)
        global_loss = accelerator.reduce(loss.detach(), reduction="mean").item()  # equal token counts per rank
        if not math.isfinite(global_loss):
            raise FloatingPointError(f"step {step}: loss {global_loss}")
        losses.append(global_loss)
        accelerator.print(f"step {step} loss {global_loss:.6f} {step_ms[-1]:.1f} ms", flush=True)
    median_ms = bench.stats(step_ms[args.warmup:])["median"]

    state = accelerator.get_state_dict(model)  # collective: every rank calls it
    if args.out is not None and accelerator.is_main_process:
        probe = torch.empty(1, 1, 1, 2, device=accelerator.device, dtype=DTYPES[args.dtype])
        record = {"model": args.model, "world_size": accelerator.num_processes,
                  "distributed_type": accelerator.distributed_type.value, "device": accelerator.device.type,
                  "patch": args.patch, "patched": patched, "fsdp": args.fsdp, "size": args.size,
                  "dtype": args.dtype, "rope_kernel": patched and args.model in ROPE_MODELS and kernels.kernel_can_run(probe),
                  "grad_checkpointing": args.grad_checkpointing, "steps": args.steps,
                  "global_batch": args.global_batch, "seq_len": args.seq_len, "seed": args.seed, "lr": args.lr,
                  "losses": losses, "warmup": args.warmup, "step_ms": step_ms, "median_step_ms": median_ms,
                  "tokens_per_s": args.global_batch * args.seq_len * 1e3 / median_ms,
                  "peak_mem_gb": (torch.cuda.max_memory_allocated(accelerator.device) / 1e9
                                  if accelerator.device.type == "cuda" else None),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                  if accelerator.device.type == "cuda" else []}
        save(args.out, state, record)
        accelerator.print(f"wrote {args.out} and {args.out.with_suffix('.json').name}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    _KEEP_UNTIL_EXIT.extend((accelerator, model, optimizer))  # the DDP model holds its Reducer and process group
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the files are written and every rank has passed the final barrier
