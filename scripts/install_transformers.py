"""Install torchembed (editable, with its test extras) and one transformers release into this interpreter.

    python scripts/install_transformers.py latest      # the newest release on the package index
    python scripts/install_transformers.py "4.57.*"    # the newest release matching a version spec
    python scripts/install_transformers.py --no-project latest   # all of it but torchembed itself

``--no-project`` installs what torchembed's extras require, not torchembed: it leaves the repository alone (an
editable install writes ``torchembed.egg-info`` there), so it can run beside another install from the same clone
(CI makes these virtualenvs while the main suite runs); ``pip install --no-deps -e .`` completes it.

A release is tested the day it appears, even when the index does not (yet) serve one of its
dependencies: if pip cannot install the release with its dependencies, the rest is installed first,
then the release without dependencies, then each of its dependencies that the index serves; the log
says which ones it does not (transformers 5.25 requires ``kernels>=0.19.1``; an index serving
``kernels`` only up to 0.17.2 lets pip's resolver fall back to 5.24 silently). The release actually
installed is printed last, as ``installed transformers X``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

EXTRAS = ".[triton,hf,dev]"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pip(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *(["-q"] if quiet else []), *args]
    return subprocess.run(command, capture_output=True, text=True)


def available_versions() -> list[Version]:
    """Every transformers release the index serves (``pip index versions``), newest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("Available versions:"))
    return sorted((Version(v.strip()) for v in line.split(":", 1)[1].split(",")), reverse=True)


def pick(spec: str) -> Version:
    """The newest final release matching ``spec`` ("latest": any)."""
    allowed = SpecifierSet("" if spec == "latest" else f"=={spec}")
    for version in available_versions():
        if not version.is_prerelease and version in allowed:
            return version
    raise SystemExit(f"install_transformers: the index serves no transformers release matching {spec!r}")


def unmet_requirements() -> list[Requirement]:
    """The installed transformers' own requirements (no extras) that are missing or of another version."""
    unmet = []
    for text in importlib.metadata.requires("transformers") or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(requirement)
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(requirement)
    return unmet


def extras_requirements() -> list[str]:
    """What ``EXTRAS`` brings besides torchembed: its dependencies and its extras', as ``pyproject.toml`` lists them."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = EXTRAS[EXTRAS.index("[") + 1:-1].split(",")
    return [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help='"latest" or a version spec such as "4.57.*" or "5.25.0"')
    parser.add_argument("--no-project", action="store_true",
                        help="install what torchembed's extras require, not torchembed (the repository is not written)")
    args = parser.parse_args(argv)
    version = pick(args.spec)
    print(f"install_transformers: {args.spec} -> transformers {version}", flush=True)
    targets = extras_requirements() if args.no_project else ["-e", EXTRAS]
    done = pip(*targets, f"transformers=={version}")
    if done.returncode == 0:
        print(f"install_transformers: transformers {version} with its dependencies")
    else:
        reason = [line for line in done.stderr.splitlines()
                  if line.startswith("ERROR:") and "Ignored the following versions" not in line][-3:]
        print(f"install_transformers: pip cannot install transformers {version} with its dependencies:")
        print("  " + "\n  ".join(reason))
        first = f"what torchembed{EXTRAS[1:]} requires" if args.no_project else f"torchembed{EXTRAS[1:]}"
        print(f"install_transformers: installing {first} first, then transformers {version} without dependencies, "
              "then each of its dependencies the index serves")
        for step in (pip(*targets), pip("--no-deps", f"transformers=={version}")):
            if step.returncode != 0:
                print(step.stderr, file=sys.stderr)
                return 1
        unserved = []
        for requirement in unmet_requirements():
            if pip(str(requirement)).returncode != 0:
                unserved.append(str(requirement))
        print("install_transformers: not served by the index, left out: " + (", ".join(unserved) or "none"))
    installed = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                               capture_output=True, text=True, check=True).stdout.strip()
    print(f"installed transformers {installed}")
    return 0 if installed == str(version) else 1


if __name__ == "__main__":
    raise SystemExit(main())
