"""The front door: each mistake ends with one line on stderr saying what is wrong and what to do,
exit code 2 and no traceback (``--debug`` shows it); ``torchembed bench`` writes to
``./torchembed-results`` (or ``--out``) and says where. No network: the hub is either switched off
(``HF_HUB_OFFLINE=1``) or a closed port on the loopback address."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from torchembed import cli

pytest.importorskip("transformers")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_missing_folder(capsys, offline) -> None:
    code, _, err = run(capsys, "compare", "./no/such/dir")
    assert code == 2
    assert one_line_error(err) == "torchembed compare: error: no such checkpoint folder: ./no/such/dir"


def test_missing_folder_subprocess_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torchembed", "compare", "./no/such/dir"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "no such checkpoint folder" in one_line_error(proc.stderr)
    assert proc.stdout == ""


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, offline) -> None:
    """A mistake at the front door exits 2 with or without --debug; --debug adds the traceback."""
    for argv in (["--debug", "compare", "./no/such/dir"], ["compare", "./no/such/dir", "--debug"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "Traceback" in err and "CheckpointNotFoundError" in err, argv
        assert err.strip().splitlines()[-1] == "torchembed compare: error: no such checkpoint folder: ./no/such/dir"
    for argv in (["--debug", "compare", "--device", "cuda:7"], ["chat", "hi", "--fused", "on", "--debug"],
                 ["--debug", "compare", "--seq-len", "0"], ["--debug", "compare", "--gguf-file", "x.gguf"]):
        code, _, err = run(capsys, *argv)
        assert code == 2, (argv, err)


def test_folder_that_is_not_a_checkpoint(capsys, tmp_path: Path, offline) -> None:
    code, _, err = run(capsys, "compare", str(tmp_path))
    assert code == 2 and "no config.json" in one_line_error(err)
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    code, _, err = run(capsys, "compare", str(tmp_path))
    assert code == 2 and "--gguf-file model.Q4_0.gguf" in one_line_error(err)
    code, _, err = run(capsys, "compare", str(tmp_path), "--gguf-file", "other.gguf")
    assert code == 2 and "no GGUF file 'other.gguf'" in one_line_error(err) and "model.Q4_0.gguf" in err
    code, _, err = run(capsys, "compare", "--gguf-file", "x.gguf")
    assert code == 2 and "torchembed compare FOLDER --gguf-file NAME" in one_line_error(err)


def test_gguf_file_without_the_gguf_package(capsys, tmp_path: Path, offline, monkeypatch) -> None:
    """The file exists: then (only then) the missing package is what to fix."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    for argv in (["compare", str(tmp_path), "--gguf-file", "model.Q4_0.gguf"], ["compare", str(tmp_path / "model.Q4_0.gguf")]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "needs the gguf package: pip install gguf" in one_line_error(err)
    code, _, err = run(capsys, "compare", str(tmp_path), "--gguf-file", "other.gguf")
    assert code == 2 and "no GGUF file 'other.gguf'" in one_line_error(err)


def test_hub_id_while_offline_is_quick(capsys, offline) -> None:
    start = time.perf_counter()
    code, _, err = run(capsys, "compare", "gpt2-like-name")
    assert code == 2
    line = one_line_error(err)
    assert "'gpt2-like-name' is not a local folder" in line and "HF_HUB_OFFLINE" in line
    assert time.perf_counter() - start < 10


@pytest.fixture
def closed_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub endpoint is a closed port on the loopback address: connecting is refused at once."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")


def test_hub_id_while_the_hub_is_unreachable(capsys, closed_hub) -> None:
    start = time.perf_counter()
    code, _, err = run(capsys, "compare", "gpt2-like-name")
    assert code == 2
    assert "the hub cannot be reached (http://127.0.0.1:" in one_line_error(err)
    assert time.perf_counter() - start < 10

    from torchembed.patches.loading import CheckpointNotFoundError, HubUnreachableError

    with pytest.raises(HubUnreachableError) as info:
        __import__("torchembed").from_pretrained("gpt2-like-name")
    assert isinstance(info.value, (CheckpointNotFoundError, FileNotFoundError, ConnectionError))


def test_cached_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(tmp_path: Path, closed_hub) -> None:
    from torchembed.patches.loading import resolve_checkpoint

    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    name, kwargs = resolve_checkpoint("org/name", cache_dir=str(tmp_path))
    assert name == "org/name" and kwargs == {"cache_dir": str(tmp_path), "local_files_only": True}


def test_from_pretrained_missing_folder(offline) -> None:
    import torchembed

    with pytest.raises(FileNotFoundError, match="no such checkpoint folder: ./no/such/dir"):
        torchembed.from_pretrained("./no/such/dir")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        torchembed.from_pretrained("gpt2-like-name")


def test_fused_on_without_cuda(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine can run --fused on")
    code, _, err = run(capsys, "compare", "--fused", "on")
    assert code == 2
    line = one_line_error(err)
    assert "--fused on needs" in line and "--fused auto" in line and "fused=None" not in line


def test_fused_unavailable_is_reported_in_cli_spelling(capsys, monkeypatch) -> None:
    from torchembed.patches.errors import FusedUnavailableError
    from torchembed.tools import compare

    def refuse(*args, **kwargs):
        raise FusedUnavailableError("fused=True: gpt2 uses learned positions, which have no fused kernel; use fused=None")

    monkeypatch.setattr(compare, "compare", refuse)
    code, _, err = run(capsys, "compare")
    assert code == 2
    assert one_line_error(err) == ("torchembed compare: error: --fused on: gpt2 uses learned positions, which have no "
                                   "fused kernel; use --fused auto")


def test_attn_choices_are_checked_up_front(capsys) -> None:
    code, _, err = run(capsys, "compare", "--attn", "flash")
    assert code == 2
    assert "invalid choice: 'flash' (choose from 'eager', 'sdpa')" in one_line_error(err)


def test_device_this_machine_lacks(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run(capsys, "compare", "--device", "cuda")
    assert code == 2
    line = one_line_error(err)
    assert line.startswith("torchembed compare: error: --device cuda: ") and line.endswith("use --device cpu")
    code, _, err = run(capsys, "compare", "--device", "nonsense")
    assert code == 2 and "not a device" in one_line_error(err)

    from torchembed.tools.compare import compare

    with pytest.raises(ValueError, match="use device='cpu'"):
        compare("./anything", device="cuda")


def test_bench_without_a_name_lists_the_benchmarks(capsys) -> None:
    code, out, err = run(capsys, "bench")
    assert code == 2 and out == ""
    assert "arguments are required" not in err and "Traceback" not in err
    assert err.splitlines()[0] == "torchembed bench: which benchmark? name one of rope, alibi, e2e, train, long, decode"
    for name in cli.BENCHMARKS:
        assert f"  {name} " in err
    assert "./torchembed-results" in err
    code, _, err = run(capsys, "bench", "--smoke")
    assert code == 2 and err.startswith("torchembed bench: which benchmark? name one of rope, alibi, e2e, train, long, decode before")


def test_bench_option_checks_are_one_line(capsys) -> None:
    code, _, err = run(capsys, "bench", "rope", "--smoke", "--shapes", "1,2,3")
    assert code == 2 and "--shapes expects B,S,HQ,HK,D" in one_line_error(err)


def test_no_command(capsys) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "name a command: compare, chat, bench or list" in err and "Traceback" not in err


def test_chat_missing_model(capsys, offline) -> None:
    code, _, err = run(capsys, "chat", "--model", "./no/such/dir", "hello")
    assert code == 2 and "no such checkpoint folder: ./no/such/dir" in one_line_error(err)


def test_bench_writes_to_torchembed_results_and_says_where(capsys, monkeypatch, tmp_path: Path) -> None:
    from torchembed.tools import bench

    def fake_main(argv):
        parser = argparse.ArgumentParser()
        bench.add_common_args(parser)
        args = parser.parse_args(argv)
        args.torch_dtype = torch.float32
        env = bench.environment(torch.device("cpu"))
        bench.write_results(args, "fake", "fake bench", env, {"results": []}, "| a |\n|---|", quiet=True)
        return 0

    monkeypatch.setitem(sys.modules, "torchembed.tools.bench_rope", types.SimpleNamespace(main=fake_main))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "rope"]) == 0
    written = tmp_path / "torchembed-results" / "fake.md"
    assert written.is_file() and (tmp_path / "torchembed-results" / "fake.json").is_file()
    assert f"results: {written.resolve()} and fake.json" in capsys.readouterr().err
    assert cli.main(["bench", "rope", "--out", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "fake.md").is_file()
    assert str((tmp_path / "elsewhere" / "fake.md").resolve()) in capsys.readouterr().err


def test_list_all_says_for_each_rotary_model_type_patched_or_why_not(capsys, monkeypatch) -> None:
    import transformers

    from torchembed.tools import zoo

    picked = ("llama", "qwen2_vl_vision", "wav2vec2-conformer", "opt")  # patched, a sub-config, refused, no RoPE
    monkeypatch.setattr(zoo, "rotary_model_types", lambda: tuple(t for t in picked if zoo.rotary_code_of(t)))
    code, out, _ = run(capsys, "list", "--all")
    assert code == 0
    assert "not checked" not in out
    lines = out.strip().splitlines()
    rows = {line.split()[0]: line for line in lines if not line.startswith("==")}
    assert rows["llama"].split(None, 1)[1].startswith("rope; 4 x rope-apply")
    for model_type in zoo.rotary_model_types():  # each under one heading, with a reason
        assert len(rows[model_type].split()) > 2, rows[model_type]
    assert "opt" in next(line for line in lines if line.startswith("== no rotary component")).split(": ", 1)[1].split(", ")
    assert lines[-1].startswith("1 patched, ") and "without a rotary component" in lines[-1]
    assert f"transformers {transformers.__version__}" in lines[-1]


@pytest.mark.parametrize("argv, option", [
    (["compare", "--seq-len", "-1"], "--seq-len"),
    (["compare", "--seq-len", "0"], "--seq-len"),
    (["compare", "--batch-size", "0"], "--batch-size"),
    (["compare", "--steps", "-3"], "--steps"),
    (["compare", "--batch-size", "two"], "--batch-size"),
    (["chat", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["chat", "hi", "--repeats", "-1"], "--repeats"),
    (["bench", "e2e", "--new-tokens", "1"], "--new-tokens"),
    (["bench", "e2e", "--batch-sizes", "1", "0"], "--batch-sizes"),
    (["bench", "alibi", "--repeats", "0"], "--repeats"),
    (["bench", "alibi", "--slow-ms", "-5"], "--slow-ms"),
    (["bench", "alibi", "--kernel", "--rounds", "0"], "--rounds"),
    (["bench", "rope", "--seed", "-1"], "--seed"),
    (["bench", "train", "--seq-lens", "0"], "--seq-lens"),
    (["bench", "rope", "--max-seconds", "nan"], "--max-seconds"),
])
def test_every_bad_number_is_one_line(capsys, argv, option) -> None:
    """Before anything is loaded or measured: exit 2, one line naming the option and the value."""
    code, out, err = run(capsys, *argv)
    line = one_line_error(err)
    assert code == 2 and f"argument {option}" in line and "expected" in line and argv[-1] in line, line
    assert out == ""


def test_compare_takes_a_tiny_model_by_name(capsys, offline, tmp_path: Path) -> None:
    code, out, err = run(capsys, "compare", "llama", "--dtype", "float32", "--attn", "sdpa", "--json",
                         "--cache-dir", str(tmp_path))
    assert code == 0, err
    rows = __import__("json").loads(out)
    assert {row["model"] for row in rows} == {"llama"} and all(row["ok"] for row in rows), rows
    assert list((tmp_path / "tiny").glob("llama-seed0-*"))  # built in the cache, as the embedded default
    # stderr is no terminal here: progress comes as lines (the last one always)
    assert [line.split(" (")[0] for line in err.splitlines()] == ["compare: 1/1"], err
    assert err.rstrip().endswith("elapsed) llama float32 sdpa ok"), err


def test_list_all_counts_add_up_to_what_it_announced(capsys, monkeypatch, tmp_path: Path) -> None:
    """The announced number of model types with rotary code is the sum of the states the last line counts,
    those whose tiny model uses no rotation included."""
    import re

    from torchembed.tools import zoo

    statuses = [zoo.ModelTypeStatus("llama", "patched", "rope; 4 x rope-apply"),
                zoo.ModelTypeStatus("wav2vec2-conformer", "refused", "an attribute"),
                zoo.ModelTypeStatus("qwen2_vl_vision", "part of", "a sub-config"),
                zoo.ModelTypeStatus("opt", "no rotary component", "its tiny model uses none of x (default config)")]
    monkeypatch.setattr(zoo, "rotary_model_types", lambda: tuple(s.model_type for s in statuses))
    monkeypatch.setattr(zoo, "survey", lambda types=None, progress=False: statuses)
    monkeypatch.setattr(zoo, "survey_cache_file", lambda: str(tmp_path / "not-yet.json"))
    code, out, err = run(capsys, "list", "--all")
    assert code == 0
    announced = int(re.search(r"checking the (\d+) model types whose modeling code has a rotary", err)[1])
    assert "on a 2-core CPU" in err
    last = out.strip().splitlines()[-1]
    counted = [int(n) for n in re.findall(r"(\d+) (?:patched|refused|partly patched|without a tiny model|sub-configs)", last)]
    unused = int(re.search(r"\((\d+) of them have rotary code their default model does not use\)", last)[1])
    assert announced == sum(counted) + unused == 4, (err, last)


def test_list_all_reports_progress_in_a_log(capsys, monkeypatch, tmp_path: Path) -> None:
    from torchembed.tools import zoo

    monkeypatch.setenv("TORCHEMBED_CACHE", str(tmp_path))
    monkeypatch.setattr(zoo, "rotary_model_types", lambda: ("llama",))
    code, _, err = run(capsys, "list", "--all")
    assert code == 0
    lines = err.strip().splitlines()
    assert lines[0].startswith("torchembed list --all: checking the 1 model types") and "under a minute" in lines[0]
    assert lines[1].startswith("checking model types: 1/1 (") and lines[1].endswith(" llama"), err


@pytest.mark.parametrize("name", ["nope.gguf", "./nope.gguf", "models/nope.Q4_0.gguf"])
def test_missing_gguf_file_is_no_such_file(capsys, name) -> None:
    """Never "the hub cannot be reached": a .gguf name is a file, not a hub id."""
    code, _, err = run(capsys, "compare", name)
    assert code == 2 and one_line_error(err) == f"torchembed compare: error: no such file: {name}"


def test_list_all_survey_is_kept_and_read_back(tmp_path: Path, monkeypatch) -> None:
    """The second survey reads the first one's file instead of building the models again."""
    from torchembed.tools import zoo

    monkeypatch.setenv("TORCHEMBED_CACHE", str(tmp_path))
    first = zoo.survey(["llama", "qwen3"])
    assert [s.model_type for s in first] == ["llama", "qwen3"] and all(s.supported for s in first)
    assert Path(zoo.survey_cache_file()).is_file()
    monkeypatch.setattr(zoo, "status_of", lambda t: pytest.fail(f"{t} checked again"))
    assert zoo.survey(["qwen3", "llama"]) == first[::-1]


def test_chat_gguf_file_needs_the_model_folder(capsys, offline) -> None:
    """Never the default model instead of the file asked for."""
    code, out, err = run(capsys, "chat", "--gguf-file", "nope.gguf", "--max-new-tokens", "1", "hi")
    line = one_line_error(err)
    assert code == 2 and out == "" and "torchembed chat --model FOLDER --gguf-file NAME" in line, line


def test_chat_missing_gguf_file_in_the_model_folder(capsys, tmp_path: Path, offline) -> None:
    code, _, err = run(capsys, "chat", "--model", str(tmp_path), "--gguf-file", "nope.gguf", "hi")
    assert code == 2 and "no GGUF file 'nope.gguf'" in one_line_error(err)


@pytest.mark.parametrize("command", ["compare", "chat"])
def test_a_file_that_is_not_gguf(capsys, tmp_path: Path, offline, command, monkeypatch) -> None:
    """Said whether or not the gguf package is installed (installing it would not help)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    (tmp_path / "junk.gguf").write_bytes(b"not a GGUF file")
    argv = [str(tmp_path / "junk.gguf")] if command == "compare" else ["--model", str(tmp_path / "junk.gguf"), "hi"]
    code, _, err = run(capsys, command, *argv)
    assert code == 2 and f"{tmp_path / 'junk.gguf'} is not a GGUF file" in one_line_error(err)


def test_compare_tiny_model_with_a_gguf_file_points_to_list(capsys, offline) -> None:
    code, _, err = run(capsys, "compare", "llama", "--gguf-file", "x.gguf")
    line = one_line_error(err)
    assert code == 2 and "'llama' is a tiny model" in line and "'x.gguf'" in line and "torchembed list" in line, line


def test_compare_unknown_name_points_to_list(capsys, offline) -> None:
    code, _, err = run(capsys, "compare", "lama")
    line = one_line_error(err)
    assert code == 2 and "no tiny model 'lama'" in line and "torchembed list" in line and "'llama'" in line, line
    assert "is not a local folder" in line  # and why no hub id of that name could be had


def test_help_imports_neither_torch_nor_transformers() -> None:
    """``torchembed --help`` is quick: the tools (and torch) are imported when a subcommand runs."""
    code = ("import sys; from torchembed import cli; cli.main(['--help']); "
            "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: torchembed" in proc.stdout, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "heavy: []"


def test_the_readme_says_how_to_put_torchembed_on_path() -> None:
    """The scripts install into .venv, which they do not activate: the README says so before the commands."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    command_line = readme.split("## Command line", 1)[1].split("```bash", 1)[0]
    for section in (quick_start, command_line):
        assert "source .venv/bin/activate" in section and ".venv/bin/torchembed" in section
