"""Patched models on several GPUs of one host: a model split over the GPUs, DDP and FSDP training.

    bash scripts/multi_gpu.sh                      # every part, every visible GPU
    python scripts/multi_gpu.py --parts infer --out benchmarks/results/$(date +%F)
    python scripts/multi_gpu.py --smoke --out /tmp/mg   # CPU, tiny configs, 2 gloo processes

Parts (``--parts``, comma-separated):

* ``infer``: a ~1B LLaMA-style and a ~0.9B BLOOM-style random-weight checkpoint (``save_pretrained``
  then ``from_pretrained(device_map="auto")``, bf16) split layer-wise over the GPUs. Logits on a
  batch with a left-padded row (real tokens only) of upstream, patched and unpatched, against a
  float32 copy of the same weights on one GPU: the patched error must not exceed upstream's by
  more than ``ERROR_ALLOWANCE`` (other bf16 ops are noisy), unpatching must restore upstream's
  logits bit for bit, and the split patched model is compared with the same model on one GPU.
  Then greedy generation, patched vs upstream on the split model, interleaved repeats: prefill
  ms and decode tokens/s.
* ``parity``: ``scripts/train_distributed.py`` (tiny configs, float32, patched with the fused
  kernels) on one GPU vs ``accelerate launch`` DDP and FSDP on all GPUs: same global batches, so
  parameters after the steps agree to float32 summation order (``PARAM_ATOL``, the reasoning is
  in tests/distributed/test_ddp.py, or twice upstream's own one-GPU vs distributed difference,
  run alike) and losses to ``LOSS_RTOL``; the one-GPU upstream run gives the patched-vs-upstream
  loss difference.
* ``tp``: transformers' own tensor parallelism: the ~1B LLaMA checkpoint loaded with
  ``from_pretrained(tp_plan="auto")`` under ``torch.distributed.run`` (one process per GPU,
  this script with ``--tp-rank``), patched. Its logits against the float32 one-GPU reference (patched no
  worse than upstream, as ``infer``) and against the patched one-GPU bf16 model (the mean
  difference within twice that model's own bf16 error: tensor parallelism only reorders sums);
  unpatch bit-exact; greedy generation, upstream and patched in turns: decode ms/token; on every rank the
  patched decode steps take torchembed's split-key kernel (counted; with ``--smoke`` its PyTorch
  implementation stands in for the GPU) and no process-wide flag changes.
* ``speed``: the ~1B LLaMA config trained in bf16 (``--size 1b``), DDP and FSDP over all GPUs and
  one GPU at the same per-GPU batch, upstream vs patched: tokens/s (median step) and peak memory.

NCCL's NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and friends, set for every child).
Writes ``multi_gpu.json`` and ``multi_gpu.md`` to ``--out`` (parts already in a ``multi_gpu.json``
there and not run again are kept, so the parts can be run in separate calls).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torchembed.tools.launch import free_port, hide_gpus, run_launcher

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train_distributed.py"
PARTS = ("infer", "parity", "tp", "speed")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ERROR_ALLOWANCE = 1.05  # patched bf16 mean error vs float32 <= 1.05 x upstream's
PARAM_ATOL, LOSS_RTOL = 1e-5, 1e-5
SPEED_STEPS, SPEED_WARMUP = 10, 3  # training steps per throughput launch, the first ones not timed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="multi_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / str(datetime.date.today()))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny configs, 2 gloo processes (checks the script)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each generation")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per training launch")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    if args.smoke:
        args.gpus = 2  # processes
    else:
        count = torch.cuda.device_count()
        args.gpus = count if args.gpus is None else args.gpus
        if args.gpus < 2 or args.gpus > count:
            parser.error(f"needs 2 or more GPUs (--gpus {args.gpus}, {count} visible); --smoke runs on CPU")
    return args


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """``torchembed.tools.bench.environment`` plus accelerate, NCCL, the GPUs and the multicast switches."""
    import accelerate

    from torchembed.tools import bench

    gpus = [] if args.smoke else [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    env = bench.environment(torch.device("cpu" if args.smoke else "cuda"))
    env.update(accelerate=accelerate.__version__,
               nccl=".".join(map(str, torch.cuda.nccl.version())) if gpus else None, gpus=gpus,
               gpus_used=args.gpus, env={k: os.environ.get(k) for k in NO_MULTICAST})
    return env


# --- infer: one model split over the GPUs -----------------------------------------------


def infer_configs(smoke: bool) -> dict[str, Any]:
    """``name -> config``: ~1B LLaMA (``torchembed bench e2e``'s) and ~0.9B BLOOM (hidden 2048, 16 layers)."""
    import transformers

    from torchembed.tools.bench_e2e import make_config
    from torchembed.tools.checkpoints import tiny_config

    if smoke:
        return {"llama": tiny_config("llama"), "bloom": tiny_config("bloom")}
    bloom = transformers.BloomConfig(hidden_size=2048, n_layer=16, n_head=16, vocab_size=32000)
    return {"llama": make_config("llama", False, 4096), "bloom": bloom}


def load(path: Path, dtype: torch.dtype, device_map: Any, gpus: int, smoke: bool) -> torch.nn.Module:
    """``from_pretrained(path)``; with ``device_map="auto"`` also checks the layers are spread over
    ``gpus`` devices (accelerate's balanced split), retrying with an explicit ``max_memory``."""
    import transformers

    from torchembed.patches.loading import load_upstream

    model = load_upstream(transformers.AutoModelForCausalLM, path, dtype=dtype, device_map=device_map).eval()
    if device_map != "auto" or smoke:
        return model
    used = {d for d in model.hf_device_map.values() if isinstance(d, int)}
    if len(used) < gpus:
        del model
        checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))  # saved in bf16
        size = checkpoint_bytes * dtype.itemsize // 2  # in memory in `dtype`
        budget = {i: int(size / gpus * 1.15) + 2**30 for i in range(gpus)}  # an even share + 15% + 1 GiB
        model = load_upstream(transformers.AutoModelForCausalLM, path, dtype=dtype, device_map="auto",
                              max_memory=budget).eval()
    return model


def batch_inputs(vocab: int, device: torch.device, smoke: bool) -> dict[str, torch.Tensor]:
    """2 rows of random ids, the second left-padded by a quarter; ``position_ids`` from the mask."""
    seq = 32 if smoke else 512
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, : seq // 4] = 0
    ids[1, : seq // 4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device)}


@torch.no_grad()
def logits_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    kwargs = dict(inputs)
    if name == "bloom":  # positions come from the mask (ALiBi); BLOOM takes no position_ids
        kwargs.pop("position_ids")
    return model(**kwargs).logits.float().cpu()


def infer_model(name: str, config: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torchembed
    from torchembed.tools import bench

    device = torch.device("cpu" if args.smoke else "cuda:0")
    split, one_device = ("cpu", "cpu") if args.smoke else ("auto", {"": 0})
    path = workdir / name
    print(f"[infer] {name}: building and saving a random-weight checkpoint", flush=True)
    torch.manual_seed(0)
    source = bench.random_causal_lm(config, device, torch.bfloat16)
    params = sum(p.numel() for p in source.parameters())
    source.save_pretrained(path)
    del source
    if device.type == "cuda":
        torch.cuda.empty_cache()

    inputs = batch_inputs(config.vocab_size, device, args.smoke)
    real = inputs["attention_mask"].bool().cpu()  # compare real tokens only
    reference = logits_of(load(path, torch.float32, one_device, args.gpus, args.smoke), inputs, name)
    model = load(path, torch.bfloat16, split, args.gpus, args.smoke)
    device_map = dict(getattr(model, "hf_device_map", {}) or {})
    upstream = logits_of(model, inputs, name)
    torchembed.patch(model)
    patched = logits_of(model, inputs, name)
    components = len(torchembed.find_positional_components(model))
    torchembed.unpatch(model)
    restored = logits_of(model, inputs, name)
    single = load(path, torch.bfloat16, one_device, args.gpus, args.smoke)
    torchembed.patch(single)
    patched_single = logits_of(single, inputs, name)
    del single

    def mean_err(x: torch.Tensor) -> float:
        return (x.double() - reference.double()).abs()[real].mean().item()

    err_up, err_patched = mean_err(upstream), mean_err(patched)
    devices = sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in device_map.values()}) or [str(device)]
    record: dict[str, Any] = {
        "model": name, "params": params, "devices": devices,
        "device_map_layers": len(device_map), "components_patched": components,
        "mean_abs_err_vs_fp32": {"upstream": err_up, "patched": err_patched},
        "max_abs_diff_patched_vs_upstream": (patched - upstream).abs()[real].max().item(),
        "argmax_agreement": (patched.argmax(-1) == upstream.argmax(-1))[real].float().mean().item(),
        "max_abs_diff_split_vs_one_gpu": (patched - patched_single).abs()[real].max().item(),
        "unpatch_bit_exact": torch.equal(restored, upstream),
    }
    record["ok"] = bool(err_patched <= ERROR_ALLOWANCE * err_up and record["unpatch_bit_exact"]
                        and len(record["devices"]) >= (1 if args.smoke else 2))
    print(f"[infer] {name}: {json.dumps(record)}", flush=True)
    record["generate"] = generation_speed(model, config.vocab_size, device, args)
    del model
    return record


def generation_speed(model: torch.nn.Module, vocab: int, device: torch.device,
                     args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy generation on the split model, upstream and patched in turns (the same object,
    patched and unpatched in place): prefill ms, decode ms/token and tokens/s, median [min, max]."""
    import torchembed
    from torchembed.tools import bench

    prompt, new_tokens = (16, 4) if args.smoke else (512, 64)
    rows = []
    for batch in (1, 8):
        ids = torch.randint(1, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(device)
        runs: dict[str, list[dict[str, float]]] = {"upstream": [], "patched": []}
        for repeat in range(args.repeats + 1):  # the first round warms up (compiles, caches)
            for variant in runs:
                if variant == "patched":
                    torchembed.patch(model)
                timing = bench.generate_timed(model, ids, new_tokens)
                torchembed.unpatch(model)
                if repeat:
                    runs[variant].append(timing)
        row: dict[str, Any] = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens}
        for variant, timings in runs.items():
            per_token = bench.stats([t["per_token"] for t in timings])
            row[variant] = {"prefill_ms": bench.stats([t["prefill"] for t in timings]), "per_token_ms": per_token,
                            "decode_tokens_per_s": batch * 1e3 / per_token["median"]}
        row["decode_speedup"] = row["upstream"]["per_token_ms"]["median"] / row["patched"]["per_token_ms"]["median"]
        print(f"[infer] generate batch {batch}: {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def tensor_parallel(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The ``tp`` part (see the module docstring)."""
    import torchembed
    from torchembed.tools import bench

    config = infer_configs(args.smoke)["llama"]
    device = torch.device("cpu" if args.smoke else "cuda:0")
    one_device = "cpu" if args.smoke else {"": 0}
    path = workdir / "llama-tp"
    torch.manual_seed(0)
    bench.random_causal_lm(config, device, torch.bfloat16).save_pretrained(path)
    inputs = batch_inputs(config.vocab_size, torch.device("cpu"), args.smoke)
    torch.save(inputs, workdir / "tp_inputs.pt")
    real = inputs["attention_mask"].bool()
    on_device = {k: v.to(device) for k, v in inputs.items()}
    reference = logits_of(load(path, torch.float32, one_device, args.gpus, args.smoke), on_device, "llama")
    single = torchembed.patch(load(path, torch.float32 if args.smoke else torch.bfloat16, one_device, args.gpus, args.smoke))
    single_patched = logits_of(single, on_device, "llama")
    del single
    if device.type == "cuda":
        torch.cuda.empty_cache()

    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1" if args.smoke else "4"}
    env["CUDA_VISIBLE_DEVICES"] = "" if args.smoke else ",".join(map(str, range(args.gpus)))  # (hide_gpus says why)
    prompt, new_tokens = (16, 4) if args.smoke else (512, 64)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", __file__, "--tp-rank", "--checkpoint", str(path), "--inputs",
           str(workdir / "tp_inputs.pt"), "--out", str(workdir / "tp"), "--repeats", str(args.repeats),
           "--prompt", str(prompt), "--new-tokens", str(new_tokens)] + (["--cpu"] if args.smoke else [])
    print(f"[tp] {args.gpus} processes: {' '.join(cmd[cmd.index('--tp-rank'):])}", flush=True)
    run = run_launcher(cmd, timeout_s=args.timeout, env=env, cwd=ROOT)
    if run.returncode != 0 or run.timed_out or not (workdir / "tp.json").exists():
        print(f"[tp] FAILED rc={run.returncode}\n{run.output[-3000:]}", flush=True)
        return {"ok": False, "error": run.output[-3000:]}
    record = json.loads((workdir / "tp.json").read_text())
    logits = torch.load(workdir / "tp.pt")

    def mean_err(x: torch.Tensor, ref: torch.Tensor) -> float:
        return (x.double() - ref.double()).abs()[real].mean().item()

    err_up, err_patched = mean_err(logits["upstream"], reference), mean_err(logits["patched"], reference)
    own_error = mean_err(single_patched, reference)
    record.update(
        mean_abs_err_vs_fp32={"tp_upstream": err_up, "tp_patched": err_patched, "one_gpu_patched": own_error},
        mean_abs_diff_tp_vs_one_gpu_patched=mean_err(logits["patched"], single_patched),
        max_abs_diff_tp_vs_one_gpu_patched=(logits["patched"] - single_patched).abs()[real].max().item(),
    )
    bound = 1e-5 * reference.abs().max().item() if args.smoke else 2 * own_error  # float32: summation order only
    route = record.get("decode_route") or []
    record["decode_route_on_every_rank"] = bool(route) and all(r["route_calls"] > 0 and r["flags_unchanged"] for r in route)
    record["ok"] = bool(err_patched <= ERROR_ALLOWANCE * err_up + 1e-7 and record["unpatch_bit_exact"]
                        and record["components_patched"] > 0 and record["mean_abs_diff_tp_vs_one_gpu_patched"] <= bound
                        and (record["generated_tokens_equal"] or not args.smoke) and record["decode_route_on_every_rank"])
    print(f"[tp] {json.dumps({k: v for k, v in record.items() if k != 'generate'})}", flush=True)
    return record


# --- tp: one rank of the tensor-parallel run (this script, started with --tp-rank) -------------------


def tp_rank(argv: list[str]) -> None:
    """One process of the ``tp`` part: ``from_pretrained(path, tp_plan="auto")``, patched. Every rank runs
    the same steps; rank 0 writes ``--out`` (``.pt``: logits of upstream, patched and unpatched on the
    batch in ``--inputs``; ``.json``: the checks and greedy-generation timings, upstream and patched in
    turns on the same model). ``--cpu``: gloo processes on the CPU, float32."""
    import torch.distributed as dist

    from torchembed.patches.loading import load_upstream

    parser = argparse.ArgumentParser(prog="multi_gpu.py --tp-rank")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True, help="a torch.save'd dict of forward inputs")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes OUT.pt and OUT.json")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.cpu:
        hide_gpus()

    import transformers

    import torchembed
    from torchembed.tools import bench

    transformers.logging.set_verbosity_error()
    dtype = torch.float32 if args.cpu else torch.bfloat16
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = load_upstream(transformers.AutoModelForCausalLM, args.checkpoint, tp_plan="auto", dtype=dtype).eval()
    device = next(model.parameters()).device
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = {k: v.to(device) for k, v in torch.load(args.inputs).items()}

    @torch.no_grad()
    def logits() -> torch.Tensor:
        return model(**inputs).logits.float().cpu()

    from torchembed.kernels import route
    from torchembed.patches.rope import decode_attention as decode_route

    route_calls = []  # the patched model's decode steps that took torchembed's split-key kernel, on this rank
    if args.cpu:  # the kernel's PyTorch implementation stands in for the GPU: the route is taken on CPU tensors
        on_gpu = route.kernel_can_run
        route.kernel_can_run = lambda t: (t.dim() == 4 and t.is_floating_point()) or on_gpu(t)
    kernel = decode_route.fused_attention
    decode_route.fused_attention = lambda *a, **kw: route_calls.append(a[0].shape[1]) or kernel(*a, **kw)
    flags = _process_flags()

    upstream = logits()
    torchembed.patch(model)
    patched = logits()
    components = len(torchembed.find_positional_components(model))
    sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    torchembed.unpatch(model)
    restored = logits()

    generate = []
    for batch in (1, 8):
        ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        runs: dict[str, list] = {"upstream": [], "patched": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for variant in runs:
                if variant == "patched":
                    torchembed.patch(model)
                out = bench.generate_timed(model, ids, args.new_tokens)
                torchembed.unpatch(model)
                if repeat:
                    runs[variant].append(out)
        row = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new_tokens}
        for variant, timings in runs.items():
            per_token = bench.stats([t["per_token"] for t in timings])
            row[variant] = {"prefill_ms": bench.stats([t["prefill"] for t in timings]), "per_token_ms": per_token}
        row["decode_speedup"] = row["upstream"]["per_token_ms"]["median"] / row["patched"]["per_token_ms"]["median"]
        generate.append(row)
    # the greedy tokens of a patched and an upstream generation agree on this model too
    ids = inputs["input_ids"][:1]
    with torch.no_grad():
        tokens_up = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torchembed.patch(model)
        tokens_pt = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torchembed.unpatch(model)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"route_calls": len(route_calls), "heads_per_rank": sorted(set(route_calls)),
                                      "flags_unchanged": _process_flags() == flags})
    if rank == 0:
        torch.save({"upstream": upstream, "patched": patched, "restored": restored}, args.out.with_suffix(".pt"))
        record = {"world_size": world, "weights": sharded, "components_patched": components,
                  "unpatch_bit_exact": torch.equal(restored, upstream),
                  "generated_tokens_equal": torch.equal(tokens_up.cpu(), tokens_pt.cpu()), "generate": generate,
                  "decode_route": per_rank}
        args.out.with_suffix(".json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _process_flags() -> tuple:
    """Process-wide settings a patched model must leave alone (SDPA's backend switches, math flags)."""
    cuda = torch.backends.cuda
    return (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())


# --- training runs (parity, speed) ------------------------------------------------------------


def launch(out: Path, procs: int, script_args: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Run train_distributed.py: one process on GPU 0 (``procs`` == 1) or ``accelerate launch`` over
    ``procs`` GPUs (torchrun with gloo on CPU for ``--smoke``). Returns its record (+ params path)."""
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1" if args.smoke else "4"}
    for key in [k for k in env if k.startswith(("ACCELERATE_", "TORCHELASTIC_"))] + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        env.pop(key, None)
    if args.smoke:  # gloo on the CPU: no process sees a GPU (hide_gpus says why)
        env["CUDA_VISIBLE_DEVICES"] = ""
    if procs == 1:
        if not args.smoke:
            env["CUDA_VISIBLE_DEVICES"] = "0"
        cmd = [sys.executable, str(TRAIN)]
    elif args.smoke:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", str(TRAIN)]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(procs)))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={procs}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
               str(TRAIN)]
    cmd += [*script_args, "--out", str(out)] + (["--cpu"] if args.smoke else [])
    print(f"[train] {' '.join(cmd[cmd.index(str(TRAIN)):])} ({procs} process{'es' if procs > 1 else ''})", flush=True)
    start = time.perf_counter()
    run = run_launcher(cmd, timeout_s=args.timeout, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if run.returncode != 0 or run.timed_out or not out.exists():
        tail = run.output[-3000:]
        print(f"[train] FAILED rc={run.returncode}\n{tail}", flush=True)
        return {"returncode": run.returncode or 1, "error": tail, "wall_s": wall}  # 1: exited 0 but wrote nothing
    record = json.loads(out.with_suffix(".json").read_text())
    record.update(returncode=0, wall_s=wall, params_file=str(out))
    return record


def params_of(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(record["params_file"])


def parity(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Single GPU vs DDP / FSDP on ``args.gpus`` GPUs, patched (tiny configs, float32)."""
    rows = []
    common = ["--steps", "3", "--global-batch", str(2 * args.gpus), "--seq-len", "32", "--lr", "1e-3"]
    modes = ["ddp"] + ([] if args.smoke else ["fsdp"])  # FSDP needs accelerator devices
    # --smoke: Falcon only (tests/distributed/test_ddp.py checks LLaMA's and BLOOM's DDP parity on the CPU)
    for model in ("falcon",) if args.smoke else ("llama", "falcon", "bloom"):
        base = [*common, "--model", model]
        single = launch(workdir / f"{model}-single.safetensors", 1, [*base, "--patch", "before"], args)
        upstream = launch(workdir / f"{model}-upstream.safetensors", 1, [*base, "--patch", "none"], args)
        for mode in modes:
            extra = ["--fsdp"] if mode == "fsdp" else []
            dist = launch(workdir / f"{model}-{mode}.safetensors", args.gpus, [*base, "--patch", "before", *extra], args)
            upstream_dist = launch(workdir / f"{model}-{mode}-upstream.safetensors", args.gpus,
                                   [*base, "--patch", "none", *extra], args)
            row: dict[str, Any] = {"model": model, "mode": mode, "processes": args.gpus}
            runs = (single, upstream, dist, upstream_dist)
            if any(r.get("returncode") for r in runs):
                row.update(ok=False, error=next(r["error"] for r in runs if r.get("returncode")))
                rows.append(row)
                continue
            a, b = params_of(single), params_of(dist)
            diffs = {k: (a[k] - b[k]).abs().max().item() for k in a if k in b}
            worst = max(diffs, key=diffs.get)
            up, up_dist = params_of(upstream), params_of(upstream_dist)
            # AdamW turns summation-order noise of a near-zero gradient into a fraction of lr, and how
            # much depends on torch's kernels (torch 2.8: 1.4e-5 on one LLaMA weight, upstream alike):
            # the bound is PARAM_ATOL or twice upstream's own one-process vs distributed difference.
            upstream_diff = max((up[k] - up_dist[k]).abs().max().item() for k in up if k in up_dist)
            bound = max(PARAM_ATOL, 2 * upstream_diff)
            loss_rel = max(abs(x - y) / abs(x) for x, y in zip(single["losses"], dist["losses"]))
            vs_upstream = max((a[k] - up[k]).abs().max().item() for k in a)
            row.update(
                distributed_type=dist["distributed_type"], rope_kernel=dist["rope_kernel"],
                same_keys=sorted(a) == sorted(b), max_param_diff=diffs[worst], worst_param=worst,
                max_param_diff_upstream=upstream_diff, param_bound=bound,
                max_loss_rel_diff=loss_rel, losses_single=single["losses"], losses_dist=dist["losses"],
                losses_upstream_single=upstream["losses"],
                max_loss_rel_diff_patched_vs_upstream=max(
                    abs(x - y) / abs(x) for x, y in zip(upstream["losses"], single["losses"])),
                max_param_diff_patched_vs_upstream=vs_upstream)
            row["ok"] = bool(row["same_keys"] and row["max_param_diff"] <= bound and loss_rel <= LOSS_RTOL
                             and dist["world_size"] == args.gpus
                             and dist["distributed_type"] == ("FSDP" if mode == "fsdp" else "MULTI_GPU" if not args.smoke
                                                              else "MULTI_CPU"))
            print(f"[parity] {model} {mode}: ok={row['ok']} max param diff {row['max_param_diff']:.2e} "
                  f"({worst}), loss rel diff {loss_rel:.2e}", flush=True)
            rows.append(row)
    return rows


def speed(args: argparse.Namespace, workdir: Path, rows: list[dict[str, Any]], save: Any) -> list[dict[str, Any]]:
    """~1B LLaMA, bf16: DDP, FSDP and one GPU (same per-GPU batch), upstream vs patched; each
    finished row is appended to ``rows`` and saved (``save()``)."""
    per_gpu, seq = (2, 32) if args.smoke else (4, 2048)
    size = ["--size", "tiny", "--dtype", "float32"] if args.smoke else ["--size", "1b", "--dtype", "bfloat16"]
    base = [*size, "--model", "llama", "--steps", str(SPEED_STEPS), "--warmup", str(SPEED_WARMUP), "--seq-len", str(seq),
            "--lr", "1e-5"]
    modes = [("ddp", args.gpus)] + ([] if args.smoke else [("fsdp", args.gpus)]) + [("one-gpu", 1)]
    for mode, procs in modes:
        row: dict[str, Any] = {"model": "llama-1b" if not args.smoke else "llama-tiny", "mode": mode,
                               "processes": procs, "global_batch": per_gpu * procs, "seq_len": seq}
        for patch in ("none", "before"):
            variant = "upstream" if patch == "none" else "patched"
            rec = launch(workdir / f"speed-{mode}-{variant}.safetensors", procs,
                         [*base, "--global-batch", str(per_gpu * procs), "--patch", patch,
                          *(["--fsdp"] if mode == "fsdp" else [])], args)
            row[variant] = ({"error": rec["error"]} if rec.get("returncode") else
                            {k: rec[k] for k in ("median_step_ms", "step_ms", "warmup", "tokens_per_s", "peak_mem_gb",
                                                 "distributed_type", "rope_kernel")})
        if "tokens_per_s" in row["upstream"] and "tokens_per_s" in row["patched"]:
            row["speedup"] = row["patched"]["tokens_per_s"] / row["upstream"]["tokens_per_s"]
        print(f"[speed] {json.dumps({k: v for k, v in row.items() if k not in ('upstream', 'patched')})}", flush=True)
        rows.append(row)
        save()
    return rows


# --- report -----------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Multi-GPU: patched vs upstream ({env['date']})", "",
             f"{env['gpus_used']} x {env['gpus'][0] if env['gpus'] else 'CPU (smoke)'}; torch {env['torch']}, "
             f"triton {env['triton']}, transformers {env['transformers']}, accelerate {env['accelerate']}, "
             f"NCCL {env['nccl']}; NVLink multicast off ({', '.join(f'{k}={v}' for k, v in env['env'].items())}).",
             ""]
    if rows := result.get("infer"):
        lines += ["## One model split over the GPUs (`device_map=\"auto\"`, bf16)", "",
                  "| model | params | devices | mean err vs fp32 upstream / patched | max diff patched-upstream "
                  "| argmax agree | split vs one GPU | unpatch exact | ok |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            e = r["mean_abs_err_vs_fp32"]
            lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {', '.join(r['devices'])} | {e['upstream']:.2e} / "
                         f"{e['patched']:.2e} | {r['max_abs_diff_patched_vs_upstream']:.2e} | "
                         f"{r['argmax_agreement']:.4f} | {r['max_abs_diff_split_vs_one_gpu']:.1e} | "
                         f"{r['unpatch_bit_exact']} | {r['ok']} |")
        lines += ["", "Greedy generation on the split model (median [min-max] of interleaved repeats):", "",
                  "| model | batch | prompt | prefill ms upstream / patched | decode ms/token upstream / patched "
                  "| decode tokens/s upstream / patched | speedup |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            for g in r["generate"]:
                u, p = g["upstream"], g["patched"]
                lines.append(f"| {r['model']} | {g['batch']} | {g['prompt']} | {u['prefill_ms']['median']:.1f} / "
                             f"{p['prefill_ms']['median']:.1f} | {_stat(u['per_token_ms'])} / {_stat(p['per_token_ms'])}"
                             f" | {u['decode_tokens_per_s']:.0f} / {p['decode_tokens_per_s']:.0f} | "
                             f"{g['decode_speedup']:.2f}x |")
        lines.append("")
    if rows := result.get("parity"):
        lines += ["## Training parity: one GPU vs all GPUs (tiny configs, float32, patched, 3 AdamW steps)", "",
                  "| model | mode | accelerate | RoPE kernel | max param diff (worst) | upstream's own | max loss rel diff "
                  "| one GPU patched vs upstream: loss / params | ok |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['mode']} | failed | | | | | | False |")
                continue
            lines.append(f"| {r['model']} | {r['mode']} | {r['distributed_type']} | {r['rope_kernel']} | "
                         f"{r['max_param_diff']:.1e} ({r['worst_param']}) | {r['max_param_diff_upstream']:.1e} | "
                         f"{r['max_loss_rel_diff']:.1e} | "
                         f"{r['max_loss_rel_diff_patched_vs_upstream']:.1e} / {r['max_param_diff_patched_vs_upstream']:.1e} | "
                         f"{r['ok']} |")
        lines += ["", f"Tolerances: parameters {PARAM_ATOL} absolute (an optimizer step moves them by ~1e-3) or twice "
                  f"upstream's own one-process vs distributed difference, whichever is larger; losses {LOSS_RTOL} "
                  "relative.", ""]
    if tp := result.get("tp"):
        lines += ["## Tensor parallel (`from_pretrained(tp_plan=\"auto\")`, LLaMA, one process per GPU)", ""]
        if "error" in tp:
            lines += ["failed:", "", "```", tp["error"][-1500:], "```", ""]
        else:
            e = tp["mean_abs_err_vs_fp32"]
            lines += [f"{tp['world_size']} processes, weights as {tp['weights']}; {tp['components_patched']} components "
                      f"patched. Mean error vs the float32 one-GPU model: TP upstream {e['tp_upstream']:.2e}, TP patched "
                      f"{e['tp_patched']:.2e}, one-GPU patched {e['one_gpu_patched']:.2e}; TP patched vs one-GPU patched: "
                      f"mean {tp['mean_abs_diff_tp_vs_one_gpu_patched']:.2e}, max {tp['max_abs_diff_tp_vs_one_gpu_patched']:.2e}; "
                      f"unpatch exact {tp['unpatch_bit_exact']}; greedy tokens equal {tp['generated_tokens_equal']}; "
                      f"ok {tp['ok']}.", "",
                      "| batch | prompt | prefill ms upstream / patched | decode ms/token upstream / patched | speedup |",
                      "|---|---|---|---|---|"]
            for g in tp["generate"]:
                u, p = g["upstream"], g["patched"]
                lines.append(f"| {g['batch']} | {g['prompt']} | {u['prefill_ms']['median']:.1f} / "
                             f"{p['prefill_ms']['median']:.1f} | {_stat(u['per_token_ms'])} / {_stat(p['per_token_ms'])} | "
                             f"{g['decode_speedup']:.2f}x |")
        lines.append("")
    if rows := result.get("speed"):
        lines += ["## Training throughput (LLaMA ~1B, bf16 AdamW, batch per GPU x 2048 tokens)", "",
                  "One launch per row and variant (upstream first), steps after the warm-up: median [min-max] ms.", "",
                  "| mode | GPUs | global batch | step ms upstream | step ms patched | tokens/s upstream | tokens/s patched "
                  "| speedup | peak GB upstream / patched |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            u, p = r["upstream"], r["patched"]
            if "error" in u or "error" in p:
                lines.append(f"| {r['mode']} | {r['processes']} | {r['global_batch']} | failed | | | | | |")
                continue
            lines.append(f"| {r['mode']} | {r['processes']} | {r['global_batch']} | {_steps(u)} | {_steps(p)} | "
                         f"{u['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {_gb(u)} / {_gb(p)} |")
        lines.append("")
    return "\n".join(lines)


def _stat(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _steps(r: dict[str, Any]) -> str:
    from torchembed.tools import bench

    timed = bench.stats(r["step_ms"][r["warmup"]:])
    return f"{timed['median']:.1f} [{timed['min']:.0f}-{timed['max']:.0f}]"


def _gb(r: dict[str, Any]) -> str:
    return "n/a" if r.get("peak_mem_gb") is None else f"{r['peak_mem_gb']:.1f}"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.update(NO_MULTICAST)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "multi_gpu_smoke" if args.smoke else "multi_gpu"
    previous = args.out / f"{name}.json"  # parts run earlier into the same folder are kept
    result: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    result.update(environment=environment(args), smoke=args.smoke)
    with tempfile.TemporaryDirectory(prefix="torchembed-multi-gpu-") as tmp:
        workdir = Path(tmp)
        def save() -> None:
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))

        for part in args.parts:
            if part == "infer":
                configs = infer_configs(args.smoke)
                result["infer"] = [infer_model(model, config, args, workdir) for model, config in configs.items()]
            elif part == "parity":
                result["parity"] = parity(args, workdir)
            elif part == "tp":
                result["tp"] = tensor_parallel(args, workdir)
            elif part == "speed":
                result["speed"] = []
                speed(args, workdir, result["speed"], save)
            save()  # after each part
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    failed = [r for part in ("infer", "parity") for r in result.get(part, []) if not r.get("ok")]
    failed += [result["tp"]] if "tp" in result and not result["tp"].get("ok") else []
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tp-rank"]:
        tp_rank(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
