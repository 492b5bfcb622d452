"""``docs/architecture.md`` tells the truth about the code: every file it names exists, and every module, function,
class, method or constant it names in backticks is defined where it says (or, named alone, somewhere in the
package)."""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("torchembed", "patches")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# words in backticks that are not the package's names: Python, torch and transformers terms, environment variables
OUTSIDE = {"torch.compile", "torch.library.custom_op", "triton.jit", "fused", "None", "True", "False", "forward",
           "generate", "DynamicCache", "StaticCache", "ALL_ATTENTION_FUNCTIONS", "sdpa_attention_forward",
           "scaled_dot_product_attention", "state_dict", "unpatch", "patch", "TRITON_INTERPRET",
           "TORCHEMBED_DISABLE_TRITON", "cudnn_decode", "use_cache", "generation_config", "torch.cat",
           "functools.cache", "kernel", "sys.modules", "model_type", "config.model_type", "torchembed.tools",
           "torchembed", "apply_rotary_pos_emb"}


def _files() -> list[Path]:
    return [p for top in SOURCES for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]


@cache
def _names(path: Path) -> frozenset[str]:
    """The names ``path`` defines: top level (functions, classes, assignments, imports) and ``Class.member``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                        for target in member.targets if isinstance(member, ast.Assign) else [member.target]:
                            if isinstance(target, ast.Name):
                                names.add(f"{node.name}.{target.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, ast.ImportFrom):  # a package face re-exports
            names.update(alias.asname or alias.name for alias in node.names)
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    """The file of a module of the package named by its dotted path, whole (``torchembed.kernels.route``; the package
    ``torchembed.patches`` is the folder ``patches``) or by its last parts (``kernels.route``, ``route``)."""
    if parts[0] == "torchembed":
        parts = ["patches", *parts[2:]] if parts[1:2] == ["patches"] else parts
        base = ROOT.joinpath(*parts)
        return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.exists()), None)
    for path in _files():
        dotted = path.relative_to(ROOT).with_suffix("").parts
        dotted = dotted[:-1] if dotted[-1] == "__init__" else dotted
        if list(dotted[-len(parts):]) == parts:
            return path
    return None


def _resolves(token: str, file: Path | None, files: list[Path]) -> bool:
    """Whether ``token`` names something defined: a module of the package (and a name inside it), a name of ``file``
    where the doc ties it to one, else a name of any of the package's files."""
    if token in OUTSIDE or token.startswith("torch.") and not token.startswith("torchembed"):
        return True
    parts = token.split(".")
    if len(parts) == 1 and hasattr(builtins, token):
        return True
    if len(parts) == 2 and parts[0] == "torchembed" and parts[1] in _face():  # the package face's lazy names
        return True
    for i in range(len(parts), 0, -1):
        module = _module_file(parts[:i])
        if module is not None:
            inside = parts[i:]
            return not inside or ".".join(inside[:2]) in _names(module)
    name = ".".join(parts[:2])
    return any(name in _names(p) or any(n.endswith(f".{name}") for n in _names(p))  # (a method of a class there)
               for p in ([file] if file is not None else files))


@cache
def _face() -> frozenset[str]:
    import torchembed

    return frozenset(torchembed.__all__)


def problems(text: str) -> list[str]:
    """What the text names that the code does not have."""
    files = _files()
    found = []
    for line in text.splitlines():
        tied = None  # in a table row, "`path/to/file.py`: `name`, ..." ties the names after the file to it
        for token in re.findall(r"`([^`]+)`", line):
            if "<" in token:  # a placeholder
                continue
            if token.endswith(".py") or "/" in token and "=" not in token:
                path = token.split(" ")[0].rstrip(":")
                candidates = [ROOT / path, ROOT / "torchembed" / path, ROOT / "torchembed" / "kernels" / path,
                              ROOT / "patches" / path]
                hit = next((c for c in candidates if c.exists()), None)
                if hit is None and not any(p.name == Path(path).name for p in files):
                    found.append(f"no file {path}")
                tied = hit if hit is not None and hit.suffix == ".py" and line.startswith("|") else None
                continue
            name = token.split("(")[0].strip()
            if IDENTIFIER.match(name) and not _resolves(name, tied, files):
                found.append(f"{name}" + (f" (in {tied.relative_to(ROOT)})" if tied else ""))
    return found


def test_everything_the_architecture_doc_names_exists():
    assert not problems(DOC.read_text(encoding="utf-8")), problems(DOC.read_text(encoding="utf-8"))


def test_a_name_or_file_the_code_lacks_is_found():
    assert problems("| a | `torchembed/kernels/route.py`: `decode_step`, `no_such_function` |") == [
        "no_such_function (in torchembed/kernels/route.py)"]
    assert problems("`torchembed/kernels/nowhere.py`") == ["no file torchembed/kernels/nowhere.py"]
    assert problems("`torchembed.kernels.route.decode_step` and `torchembed.kernels.route.nothing_here`") == [
        "torchembed.kernels.route.nothing_here"]
    assert problems("`RotaryEmbedding.forward`, `Launches`, `NoSuchClass.method`") == ["NoSuchClass.method"]
    assert problems("`launch.Launch`, `kernels.route.use_kernel`, `launch.NoLaunch`") == ["launch.NoLaunch"]
