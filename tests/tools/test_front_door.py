"""What a new user meets first: ``--version``, the help texts, the package face (``dir``, ``help``, every
documented name), progress lines in a log, and a bare ``pip install .`` (no transformers), where every
command that needs transformers exits 2 with one line naming the fix and the Python API raises one
ImportError saying the same. None of these tests needs transformers: the bare install is simulated in a
subprocess whose imports of the ``hf`` extra's packages fail."""

from __future__ import annotations

import io
import os
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchembed
from torchembed import cli
from torchembed.tools import progress

ROOT = Path(__file__).resolve().parents[2]
HINT = "pip install 'torchembed[hf]'"

# The hf extra's packages (and NumPy, which a bare install of torch lacks) are not found, as if not installed:
# every finder answers None for them (``import`` raises ModuleNotFoundError, ``find_spec`` returns None).
BARE = """
import sys
BLOCKED = {"transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "numpy"}
class _NotInstalled:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [_NotInstalled(f) for f in sys.meta_path]
"""


def bare(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHEMBED_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", BARE + code], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env=env)


def test_version(capsys) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"torchembed {torchembed.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{torchembed.__version__}"' in pyproject


def test_bench_help_has_one_usage_line(capsys) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "usage:" in line] == [f"usage: {cli.BENCH_USAGE}"], out
    for name in cli.BENCHMARKS:
        assert f"  {name} " in out


def test_compare_all_help_says_what_it_covers(capsys) -> None:
    """``compare --all`` compares the patched model types with a causal-LM class (143 of 318 on transformers 5.23),
    not every patched model type: its help and the README say so."""
    assert cli.main(["compare", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "every model type torchembed patches that has a causal-LM class" in help_text
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if line.startswith("torchembed compare --all"))
    assert "causal-LM class" in line, line


def test_the_readme_lists_every_benchmark() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if line.startswith("torchembed bench "))
    assert line.split()[2].split("|") == list(cli.BENCHMARKS), line


def test_dir_and_help_show_the_public_names() -> None:
    names = dir(torchembed)
    assert set(torchembed.__all__) <= set(names)
    assert not {"Any", "annotations", "importlib", "_PATCH_API"} & set(names), names
    text = pydoc.render_doc(torchembed)
    for name in ("RotaryEmbedding", "from_pretrained", "CheckpointNotFoundError", "patch", "compare"):
        assert name in text, name


def test_every_public_name_resolves() -> None:
    for name in torchembed.__all__:
        assert getattr(torchembed, name) is not None, name
    assert issubclass(torchembed.CheckpointNotFoundError, FileNotFoundError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        torchembed.nope  # noqa: B018


def test_every_name_the_docs_use_resolves() -> None:
    """``torchembed.X`` in the README and docs/ (``torchembed.tools.chat``: its first part) is an attribute."""
    texts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    texts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))]
    used = {m for text in texts for m in re.findall(r"\btorchembed\.([A-Za-z_]\w*)", text)}
    used = {name for name in used if not name.startswith("_")}  # torchembed._rebound.*: modules rebind.py names
    assert "CheckpointNotFoundError" in used and "from_pretrained" in used
    assert [name for name in sorted(used) if not hasattr(torchembed, name)] == []


def test_progress_lines_in_a_log() -> None:
    out = io.StringIO()
    with progress.progress(3, "checking", stream=out, interval=0) as advance:
        for label in ("a", "b", "c"):
            advance(label)
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["checking: 1/3", "checking: 2/3", "checking: 3/3"], lines
    assert all("elapsed" in line for line in lines) and lines[0].endswith(" left) a")
    assert "left" not in lines[-1] and lines[-1].endswith(") c")


def test_progress_lines_are_spaced_out() -> None:
    """A log gets a line every ``interval`` seconds and the last one, not a line per step."""
    out = io.StringIO()
    with progress.progress(100, "checking", stream=out, interval=3600) as advance:
        for i in range(100):
            advance(str(i))
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
    assert out.getvalue().startswith("checking: 100/100")
    assert progress.clock(754.2) == "12:34" and progress.clock(3723) == "1:02:03"


@pytest.mark.parametrize("argv", [["compare", "llama"], ["compare", "--all"], ["chat", "hi"], ["list", "--all"],
                                  ["bench", "e2e", "--smoke"]])
def test_without_transformers_a_command_says_what_to_install(tmp_path: Path, argv: list[str]) -> None:
    proc = bare(f"from torchembed.cli import main; sys.exit(main({argv!r}))", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"torchembed {argv[0]}: error: ") and HINT in lines[0], lines[0]
    assert "transformers" in lines[0] and proc.stdout == ""


def test_without_transformers_list_works_and_says_nothing_on_stderr(tmp_path: Path) -> None:
    proc = bare("from torchembed.cli import main; sys.exit(main(['list']))", tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "llama" in proc.stdout and "list --all" in proc.stdout


def test_without_transformers_the_api_raises_one_import_error(tmp_path: Path) -> None:
    code = """
import torchembed
print(sorted(set(torchembed.__all__) - set(dir(torchembed))))
for name in ("compare", "from_pretrained", "patch", "patched"):
    try:
        getattr(torchembed, name)("llama")
    except ImportError as exc:
        assert exc.__cause__ is None and exc.__suppress_context__, name
        print(name, "|", exc)
print(torchembed.is_patched(object()), torchembed.CheckpointNotFoundError.__name__)
"""
    proc = bare(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "[]"
    assert [line.split(" |")[0] for line in lines[1:5]] == ["compare", "from_pretrained", "patch", "patched"]
    for line in lines[1:5]:
        name = line.split(" |")[0]
        assert f"torchembed.{name} needs transformers (No module named 'transformers'): {HINT}" in line, line
    assert lines[5] == "False CheckpointNotFoundError"


def test_the_api_is_upstreams_own_where_transformers_is_installed() -> None:
    pytest.importorskip("transformers")
    from torchembed import patches
    from torchembed.tools import compare

    assert torchembed.patch is patches.patch and torchembed.from_pretrained is patches.from_pretrained
    assert torchembed.compare is compare.compare


def test_outside_a_terminal_tqdm_bars_are_off(tmp_path: Path) -> None:
    """transformers' GGUF conversion draws a tqdm bar: in a log every refresh would be a line."""
    code = """
import sys
from torchembed import cli
cli._quiet_outside_a_terminal()
from tqdm.auto import tqdm
for _ in tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."):
    pass
print("done")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TQDM_DISABLE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]
    assert "Converting" not in proc.stderr and proc.stderr == "", proc.stderr[-2000:]
