"""``torchembed bench {rope,e2e,alibi,long} --smoke``: each runs on CPU in seconds and writes JSON and
markdown with one finite entry per provider (variant) x shape. No timing assertions."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from torchembed.tools import bench


def _run(what: str, tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    assert bench.main([what, "--smoke", "--out", str(tmp_path), *extra]) == 0
    name = f"{what}-smoke"
    json_path, md_path = tmp_path / f"{name}.json", tmp_path / f"{name}.md"
    assert json_path.is_file() and md_path.is_file()
    data = json.loads(json_path.read_text())
    md = md_path.read_text()
    for key in ("date", "gpu", "torch", "python"):
        assert data["env"][key]
    assert "- date:" in md and "torch" in md
    return data, md


def _finite(x: Any) -> bool:
    if isinstance(x, dict):
        return all(_finite(x[k]) for k in ("median", "min", "max"))
    return isinstance(x, (int, float)) and math.isfinite(x)


def _one(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_rope_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, md = _run("rope", tmp_path)
    providers, shapes, records = data["providers"], data["shapes"], data["results"]
    assert {"torchembed", "torchembed-angles"} <= set(providers) and shapes
    assert data["env"]["copy_bandwidth_gbs"] > 0
    for shape in shapes:
        assert _finite(_one(records, section="forward", provider="floor", shape_label=shape)["ms"])
        assert _finite(_one(records, section="forward", provider="copy", shape_label=shape)["ms"])
        for provider in providers:
            for section in ("forward", "forward+backward"):
                assert _finite(_one(records, section=section, provider=provider, shape_label=shape)["ms"])
            err = _one(records, section="accuracy", provider=provider, shape_label=shape)["max_abs_err"]
            assert _finite(err) and err < 0.1  # bf16 rounding of unit-scale values
        assert shape in md
    decode = [s for s in shapes if s.split()[0].endswith("x1")]
    for shape in decode:
        for provider in providers:
            assert _finite(_one(records, section="host", provider=provider, shape_label=shape)["us_per_call"])
    assert "% of floor" in md
    assert "liger" in data["skipped"] or "liger" in providers
    assert capsys.readouterr().out.strip().endswith(md.strip().splitlines()[-1])  # markdown printed last


def test_e2e_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data, md = _run("e2e", tmp_path)
    records = data["results"]
    variants = [v for v in data["variants"] if any(r["variant"] == v for r in records)]
    assert {"upstream", "patched"} <= set(variants)
    for model in ("llama", "mistral", "falcon"):
        for batch in (1, 2):
            for phase in ("prefill", "decode"):
                for variant in variants:
                    rec = _one(records, model=model, batch=batch, phase=phase, variant=variant)
                    assert _finite(rec["ms"]), rec
                    if phase == "decode":
                        assert _finite(rec["tokens_per_s"])
                    if variant == "patched":  # per-repeat upstream / patched, from the recorded runs
                        up = _one(records, model=model, batch=batch, phase=phase, variant="upstream")["ms"]
                        values = list(zip(up["values"], rec["ms"]["values"]))
                        # (on a loaded CPU a decode time, (generate(N) - generate(1)) / (N - 1), can come out <= 0:
                        # such a pair is left out, and with no pair left there is no paired figure)
                        pairs = [u / p for u, p in values if p > 0]
                        paired = rec["paired_speedup"]
                        assert len(values) == 2
                        assert paired["values"] == pytest.approx(pairs) if pairs else paired is None
    assert "prefill latency" in md and "eager decode" in md and "paired" in md


def test_e2e_step_phase(tmp_path: Path) -> None:
    """One decode forward per call, the variants alternating: every call timed and finite."""
    pytest.importorskip("transformers")
    from torchembed.tools import bench_e2e

    data, md = _run("e2e", tmp_path, "--phases", "step", "--models", "llama", "--batch-sizes", "2", "--name", "e2e-smoke")
    for variant in ("upstream", "patched"):
        rec = _one(data["results"], model="llama", batch=2, phase="step", variant=variant)
        assert rec["ms"]["n"] == 2 * bench_e2e.STEP_CALLS and _finite(rec["ms"])
    assert "one decode forward" in md


def test_e2e_step_phase_rolls_the_cache_back() -> None:
    """Every timed step sees the prompt's cache: after many steps the cache holds prompt + 1 tokens."""
    transformers = pytest.importorskip("transformers")
    from torchembed.tools import bench_e2e

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=64, vocab_size=64)
    model = transformers.LlamaForCausalLM(config).eval()
    seen: list[int] = []
    forward = model.forward

    def spy(*args, past_key_values=None, **kwargs):
        seen.append(past_key_values.get_seq_length() if past_key_values is not None else -1)
        return forward(*args, past_key_values=past_key_values, **kwargs)

    model.forward = spy
    ids = torch.randint(0, 64, (1, 5))
    res = bench_e2e._measure_steps({"upstream": model}, ids, 4, torch.device("cpu"), {})
    assert res["upstream"]["ms"]["n"] == 4 and seen == [-1] + [5] * 5  # prefill, warm-up step, 4 timed steps


def test_interleave_alternates_the_order() -> None:
    calls: list[str] = []
    out = bench.interleave({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"] and out == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_gc_paused_collects_the_last_runs_cycles_and_keeps_the_collector_off() -> None:
    """A cycle dropped before the block, with the collector off as it is in a timed run (so the cycle is
    young), is collected on entry; inside, the collector is off; after, it is as it was before."""
    import gc
    import weakref

    class Node:
        pass

    assert gc.isenabled()
    gc.disable()  # (also keeps other threads' allocations from ageing the cycle before the block)
    try:
        node = Node()
        node.self = node
        dead = weakref.ref(node)
        del node
        with bench.gc_paused():
            assert dead() is None and not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with bench.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failing_variant_keeps_its_whole_error_and_the_others_run() -> None:
    """A variant whose run raises is recorded, not fatal: the table gets the first line, the JSON the whole message
    (an error from inductor's compile subprocess says only "An exception occurred in a subprocess:" on its first
    line; the worker's traceback follows it)."""
    worker_trace = "Traceback (most recent call last):\n  File \"worker.py\", line 7\nValueError: the real cause"

    def run(model: torch.nn.Module) -> float:
        if isinstance(model, torch.nn.Identity):
            raise RuntimeError("An exception occurred in a subprocess:\n\n" + worker_trace)
        return 1.0

    res = bench.measure({"broken": torch.nn.Identity(), "fine": torch.nn.Linear(1, 1)}, run, 2, torch.device("cpu"))
    assert res["broken"]["ms"] == "error (RuntimeError: An exception occurred in a subprocess:)"
    assert res["broken"]["error_detail"].endswith("ValueError: the real cause")
    assert worker_trace in res["broken"]["error_detail"]
    assert res["fine"]["ms"]["n"] == 2 and "error_detail" not in res["fine"]
    long = RuntimeError("x" * 10_000 + " the end")
    assert len(bench.error_detail(long)) == 4000 and bench.error_detail(long).endswith(" the end")


def test_paired_ratio() -> None:
    a, b = bench.stats([2.0, 9.0, 3.0]), bench.stats([1.0, 3.0, 6.0])
    assert bench.paired_ratio(a, b) == bench.stats([2.0, 3.0, 0.5])
    assert bench.paired_ratio(bench.stats([1.0, math.nan]), bench.stats([2.0, 1.0]))["values"] == [0.5]
    assert bench.paired_ratio(a, {}) is None


def test_alibi_smoke(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data, md = _run("alibi", tmp_path, "--seq-lens", "16", "--batch-sizes", "1", "2",
                    "--variants", "upstream", "patched", "patched-kernel")
    records = data["results"]
    for model in ("bloom", "mpt", "falcon"):
        for variant in ("upstream", "patched", "patched-kernel"):
            for batch in (1, 2):
                assert _finite(_one(records, model=model, phase="prefill", batch=batch, seq_len=16, variant=variant)["ms"])
                assert _finite(_one(records, model=model, phase="decode", batch=batch, variant=variant)["ms"])
    assert "prefill latency" in md and "Falcon `sdpa`" in md
    assert "upstream / patched |" in md and "upstream / patched-kernel |" in md
    assert "tanh-GELU" in md  # BLOOM's own activation is named as what is left


def test_alibi_on_the_cpu_runs_with_its_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cpu --threads N``: the CPU, N intra-op threads in this benchmark's process, named in the results;
    ``--threads`` without the CPU is refused."""
    pytest.importorskip("transformers")
    from torchembed.tools import bench_alibi

    full_size = bench_alibi.make_config
    monkeypatch.setattr(bench_alibi, "make_config", lambda name, smoke, max_len: full_size(name, True, max_len))  # tiny
    before = torch.get_num_threads()
    try:
        assert bench.main(["alibi", "--device", "cpu", "--threads", "1", "--dtype", "float32", "--models", "mpt",
                           "--phases", "prefill", "--seq-lens", "8", "--batch-sizes", "1", "--repeats", "1",
                           "--out", str(tmp_path)]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    data = json.loads((tmp_path / "alibi-cpu-mpt-prefill.json").read_text())
    assert data["env"]["threads"] == 1 and data["options"]["device"] == "cpu"
    assert _finite(_one(data["results"], model="mpt", seq_len=8, variant="patched")["ms"])
    with pytest.raises(SystemExit):
        bench.main(["alibi", "--threads", "2", "--out", str(tmp_path)])


def test_alibi_kernel_smoke(tmp_path: Path) -> None:
    assert bench.main(["alibi", "--kernel", "--smoke", "--out", str(tmp_path), "--passes", "forward",
                       "--rounds", "2"]) == 0
    data = json.loads((tmp_path / "alibi-kernel-smoke.json").read_text())
    md = (tmp_path / "alibi-kernel-smoke.md").read_text()
    by = {(r["label"], r["impl"]): r for r in data["results"]}
    for label in ("prefill 1,2,64,16", "decode 1,2,1x64,16"):
        for impl in ("floor", "torchembed", "sdpa-bias"):
            assert _finite(by[(label, impl)]["ms"]), (label, impl)
        assert by[(label, "torchembed")]["max_err"] < 1e-5
        rounds = by[(label, "torchembed")]["ms_rounds"]  # the cell: the median of the interleaved rounds
        assert len(rounds) == 2 and by[(label, "torchembed")]["ms"] == pytest.approx(sum(rounds) / 2)
        for impl in ("sdpa-flash", "sdpa-cudnn"):  # the floor held to one backend: CUDA only, no ALiBi error
            ms = by[(label, impl)]["ms"]
            assert ms == "CUDA only" or _finite(ms), (label, impl, ms)
            assert by[(label, impl)].get("max_err") is None
    assert "sdpa-flash (ms) | sdpa-cudnn (ms)" in md and "max error: torchembed / kernel /" in md
    assert "## prefill, forward" in md and "## decode" in md and "not installed" in md


def test_alibi_kernel_table_of_graph_replays() -> None:
    """The CUDA-graph pass gets its own table, ratios against the floor's replay."""
    from torchembed.tools import bench_alibi_kernel as kernel_bench

    def record(impl, ms, pass_):
        return {"shape": [4, 16, 2048, 64], "q_len": 2048, "phase": "prefill", "pass": pass_, "impl": impl,
                "label": "prefill 4,16,2048,64", "ms": ms, "max_err": None}

    md = kernel_bench.markdown([record("floor", 0.5, "forward+backward"), record("kernel", 0.6, "forward+backward"),
                                record("floor", 0.4, kernel_bench.GRAPH_PASS),
                                record("kernel", 0.32, kernel_bench.GRAPH_PASS)])
    graph = md.split("replayed from a CUDA graph")[1]
    assert "| 4,16,2048,64 | 0.400 |" in graph and "0.320 (1.25x)" in graph
    assert "0.600 (0.83x)" in md.split("replayed from a CUDA graph")[0]


def test_dispatch_and_validation(tmp_path: Path) -> None:
    assert bench.main(["nope"]) == 2
    with pytest.raises(ValueError, match="B,S,HQ,HK,D"):
        bench.main(["rope", "--smoke", "--out", str(tmp_path), "--shapes", "1,2,3"])


def test_long_smoke(tmp_path: Path) -> None:
    """Every model x variant x context has a finite prefill, decode and generate time, its floors and the
    memory columns; the markdown names the method."""
    pytest.importorskip("transformers")
    data, md = _run("long", tmp_path, "--models", "mpt", "llama", "--contexts", "32", "--steps", "3", "--generate", "4")
    records = data["results"]
    assert data["copy_bandwidth_gbs"] > 0 and data["matmul_tflops"] > 0
    for model in ("mpt", "llama"):
        for variant in ("upstream", "patched"):
            rec = _one(records, model=model, variant=variant, context=32)
            assert len(rec["decode_steps_ms"]) == 3
            for key in ("prefill_ms", "decode_ms", "prefill_floor_ms", "decode_floor_ms", "kv_gb", "weights_gb"):
                assert _finite(rec[key]) and rec[key] > 0, (model, variant, key, rec[key])
            assert _finite(rec["generate_ms"])  # a difference of two timings: its sign is noise on a busy CPU
            assert _finite(rec["generate_steady_ms"]) and rec["generate_steady_ms"] > 0  # (a step's own wall time)
    assert "generate ms/token" in md and "generate steady ms/token" in md and "plain-loop steps" in md
    assert "of floor" in md


def test_long_smoke_prints_its_table_once_without_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Progress goes to stderr as one line per cell; the table is printed once; a column the CPU does not
    measure (peak GPU memory) reads "-"."""
    pytest.importorskip("transformers")
    assert bench.main(["long", "--smoke", "--out", str(tmp_path), "--models", "mpt", "--contexts", "32", "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    printed = out + err
    for variant in ("upstream", "patched"):
        assert printed.count(f"mpt | {variant} | 32 |") == 1, printed
    assert "nan" not in printed.lower() and "nan" not in (tmp_path / "long-smoke.md").read_text().lower()


def test_decode_sweep_configuration_reaches_the_kernel_launch() -> None:
    """Each point of ``bench decode --sweep``'s grid changes what the decode launch is given: its blocks, and its
    key split at exactly the programs per multiprocessor asked for (the CPU counts 16 multiprocessors)."""
    from torchembed.kernels.attention_plan import _decode_splits
    from torchembed.kernels.settings import changed, settings
    from torchembed.tools import bench_decode

    grid = bench_decode._grid(smoke=False)
    assert len(grid) == len(set(grid)) and {stages for (_, _, _, stages), _ in grid} == {1, 2, 3, 4}
    cpu = torch.device("cpu")
    for per_sm, masked in itertools.product((1, 2, 4, 8), (False, True)):
        with changed(alibi=bench_decode._tuning((16, 32, 2, 1), per_sm, 128, masked)):
            assert settings().alibi.blocks[("decode", 128, masked)] == (16, 32, 2, 1)
            # 8 programs (batch x kv heads) over 16384 keys in blocks of 64: per_sm x 16 programs in all
            assert _decode_splits(cpu, 8, 16384, 64, masked) == per_sm * 2


def test_decode_sweep_table_ranks_each_case_fastest_first() -> None:
    """The sweep's table lists each case's fastest configurations in order, leaving out those that failed."""
    from torchembed.tools import bench_decode

    gen = torch.Generator().manual_seed(0)
    records = [{"case": case, "keys": 16384, "config": (16, n, 4, 3), "per_sm": p,
                "ms": float(torch.rand((), generator=gen)) / 10}
               for case in ("gqa", "alibi") for n in (32, 64, 128) for p in (1, 2)]
    records.append({"case": "gqa", "keys": 16384, "config": (16, 256, 8, 4), "per_sm": 1, "error": "out of memory"})
    best = {f"{c}@16384": min((r for r in records if r["case"] == c and "ms" in r), key=lambda r: r["ms"])
            for c in ("gqa", "alibi")}
    table = bench_decode.sweep_table({"records": records, "best": best}, top=3).splitlines()[2:]
    assert len(table) == 6 and "256" not in "".join(table)
    for i, case in enumerate(("gqa", "alibi")):
        rows = [line.split("|") for line in table[3 * i: 3 * i + 3]]
        times = [float(r[6]) for r in rows]
        assert [r[1].strip() for r in rows] == [case] * 3 and times == sorted(times)
        assert times[0] == pytest.approx(best[f"{case}@16384"]["ms"] * 1e3, abs=0.051)


def test_generate_is_timed_as_a_user_calls_it():
    """``bench e2e``'s eager decode and ``bench long``'s generate columns call ``generate`` plainly: no ``use_cache``
    (the model's generation config decides: MPT's turns the cache off upstream, a patched MPT keeps it), no compile
    or cache flags; the compiled columns ask for their static cache themselves."""
    import torch

    from torchembed.tools import bench, bench_long

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = []

        def generate(self, ids, **kwargs):
            self.calls.append(kwargs)
            for processor in kwargs.get("logits_processor") or ():
                processor(ids, None)

    model = Recorder()
    bench.generate_timed(model, torch.ones(1, 4, dtype=torch.long), 3)
    bench_long.generate_ms(model, 8, 32, 4, 0, torch.device("cpu"), repeats=1)
    assert model.calls and all("use_cache" not in kw and "cache_implementation" not in kw for kw in model.calls)
    model.calls.clear()
    bench_long.generate_ms(model, 8, 32, 4, 0, torch.device("cpu"), compiled=True, repeats=1)
    assert all(kw["use_cache"] is True and kw["cache_implementation"] == "static" for kw in model.calls)
