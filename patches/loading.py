"""``from_pretrained``: load an HF checkpoint with transformers, then patch it.

Before transformers is asked, :func:`resolve_checkpoint` checks that the checkpoint can be had, with one line saying
what to do instead of transformers' "Repo id must be in the form ..." or half a minute of retries against an
unreachable hub.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from torchembed.patches.core import patch

__all__ = ["from_pretrained", "load_upstream", "model_class_for", "resolve_checkpoint", "load_config",
           "CheckpointNotFoundError", "HubUnreachableError", "MissingDependencyError"]

_ENCODERS = {"bert"}
#: keyword arguments that say where a checkpoint's files are (given to the config and the model alike)
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token",
               "trust_remote_code", "gguf_file")
HUB_PROBE_TIMEOUT = 5.0  # seconds: one HEAD request to the hub endpoint before an uncached hub id is loaded


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint is not a local folder and cannot be had from the hub (or its folder lacks a file)."""


class HubUnreachableError(CheckpointNotFoundError, ConnectionError):
    """A hub id that is not cached locally, while the hub cannot be reached."""


class MissingDependencyError(ImportError):
    """A package the checkpoint needs is not installed (``gguf`` for GGUF files)."""


def model_class_for(config: Any) -> Any:
    """The transformers class a checkpoint was saved from (``config.architectures``), else an Auto class."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel if config.model_type in _ENCODERS else transformers.AutoModelForCausalLM


def load_upstream(model_class: Any, name_or_path: str | os.PathLike[str], **hf_kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(name_or_path, **hf_kwargs)``, unpatched, as transformers loads it,
    except that a missing hub-kernels package never stops the load.

    transformers 5.25 turns its hub kernels on by default (``use_kernels``) and raises when the
    ``kernels`` package it needs is not installed; earlier releases default to off. Without that
    package, and unless the caller says otherwise, the model is loaded with ``use_kernels=False``:
    what every release before 5.25 does and what 5.25 does with ``USE_HUB_KERNELS=0``.
    """
    if "use_kernels" not in hf_kwargs and not _hub_kernels_installed():
        hf_kwargs = {**hf_kwargs, "use_kernels": False}
    return model_class.from_pretrained(name_or_path, **hf_kwargs)


def _hub_kernels_installed() -> bool:
    """Whether transformers finds a ``kernels`` package it can use (its own check, by release)."""
    from transformers.utils import import_utils

    check = getattr(import_utils, "is_kernels_available", None)
    return bool(check()) if check is not None else False


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (read now, not at import time)."""
    truthy = {"1", "on", "yes", "true"}
    if any(os.environ.get(k, "").strip().lower() in truthy for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers requires huggingface_hub
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _looks_like_path(name: str) -> bool:
    """A name that cannot be a hub id (``./x``, ``/x``, ``~/x``, ``a/b/c``, ...)."""
    if name.startswith((".", "/", "~", "\\")) or name.count("/") > 1 or os.sep in name.replace("/", ""):
        return True
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(name)
    except ImportError:  # pragma: no cover
        return False
    except Exception:  # HFValidationError: not a repo id
        return True
    return False


def _hub_problem(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the hub endpoint cannot be reached (``None`` when it answers), in a few words."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # connection refused, name resolution, timeout, proxy errors, ...
        text = str(exc).strip().splitlines()
        return f"{constants.ENDPOINT}: {text[0] if text else type(exc).__name__}"
    return None


def _cached(repo_id: str, filename: str, kwargs: dict[str, Any]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    subfolder = kwargs.get("subfolder") or ""
    path = f"{subfolder}/{filename}" if subfolder else filename
    try:
        found = try_to_load_from_cache(repo_id, path, cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
    except Exception:
        return False
    return isinstance(found, str)


def _check_folder(folder: Path, shown: str, kwargs: dict[str, Any]) -> None:
    subfolder = kwargs.get("subfolder") or ""
    where = folder / subfolder if subfolder else folder
    if not where.is_dir():
        raise CheckpointNotFoundError(f"no folder {subfolder!r} in {shown} (subfolder=)")
    gguf_file = kwargs.get("gguf_file")
    ggufs = sorted(p.name for p in where.glob("*.gguf"))
    if gguf_file:
        if not (where / gguf_file).is_file():
            found = f"GGUF files there: {', '.join(ggufs)}" if ggufs else "it has no .gguf file"
            raise CheckpointNotFoundError(f"no GGUF file {gguf_file!r} in {shown} ({found})")
        with open(where / gguf_file, "rb") as f:  # (transformers' own error would be a traceback)
            if f.read(4) != b"GGUF":
                raise CheckpointNotFoundError(f"{where / gguf_file} is not a GGUF file (it does not start with the "
                                              "GGUF magic bytes)")
        return
    if kwargs.get("config") is not None or (where / "config.json").is_file() or (where / "adapter_config.json").is_file():
        return
    if ggufs:
        raise CheckpointNotFoundError(
            f"{shown} has no config.json but a GGUF file: pass gguf_file={ggufs[0]!r} (CLI: --gguf-file {ggufs[0]})"
        )
    raise CheckpointNotFoundError(
        f"{shown} is not a transformers checkpoint (no config.json): pass a folder written by save_pretrained"
    )


def _require_gguf(kwargs: dict[str, Any]) -> None:
    import importlib.util

    if kwargs.get("gguf_file") and importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError("reading a GGUF file needs the gguf package: pip install gguf")


def resolve_checkpoint(name_or_path: str | os.PathLike[str], **hf_kwargs: Any) -> tuple[str, dict[str, Any]]:
    """Check that ``name_or_path`` can be loaded before transformers tries; return what to load.

    Returns ``(name_or_path, hf_kwargs)`` to hand to transformers: a path to a ``.gguf`` file
    becomes its folder plus ``gguf_file=``; a hub id that is cached while the hub cannot be
    reached gets ``local_files_only=True`` (transformers would otherwise retry for half a minute).

    Raises:
        CheckpointNotFoundError: a missing local folder or file, a folder or file that is not a checkpoint,
            or a hub id that is not cached while the hub is offline (``HF_HUB_OFFLINE=1``) or ``local_files_only=True``.
        HubUnreachableError: a hub id that is not cached and the hub does not answer.
        MissingDependencyError: ``gguf_file`` without the ``gguf`` package.
    """
    kwargs = dict(hf_kwargs)
    name = os.fspath(name_or_path)
    local = Path(os.path.expanduser(name))
    if local.is_file():
        if local.suffix == ".gguf" and not kwargs.get("gguf_file"):
            kwargs["gguf_file"] = local.name
            local, name = local.parent, str(local.parent)
        else:
            raise CheckpointNotFoundError(f"{name} is a file; pass the checkpoint folder that holds it")
    if local.is_dir():
        _check_folder(local, name, kwargs)  # a wrong name first: installing gguf would not help it
        _require_gguf(kwargs)
        return str(local), kwargs
    if local.suffix == ".gguf":  # a file name, never a hub id
        raise CheckpointNotFoundError(f"no such file: {name}")
    if _looks_like_path(name):
        raise CheckpointNotFoundError(f"no such checkpoint folder: {name}")
    _require_gguf(kwargs)
    # a hub id
    gguf_file = kwargs.get("gguf_file")
    filenames = [gguf_file] if gguf_file else ["config.json", "adapter_config.json"]
    cached = any(_cached(name, f, kwargs) for f in filenames)
    if kwargs.get("local_files_only"):
        if not cached:
            raise CheckpointNotFoundError(
                f"{name!r} is not a local folder and not in the Hugging Face cache (local_files_only=True): "
                "pass a checkpoint folder, or drop local_files_only to download it"
            )
        return name, kwargs
    if _offline():
        if not cached:
            raise CheckpointNotFoundError(
                f"{name!r} is not a local folder and not in the Hugging Face cache, and the hub is switched off "
                "(HF_HUB_OFFLINE=1): pass a checkpoint folder, or unset HF_HUB_OFFLINE to download it"
            )
        return name, kwargs
    problem = _hub_problem()
    if problem is not None:
        if cached:
            kwargs["local_files_only"] = True
            return name, kwargs
        raise HubUnreachableError(
            f"{name!r} is not a local folder, not in the Hugging Face cache, and the hub cannot be reached "
            f"({problem}): pass a checkpoint folder (e.g. one written with save_pretrained)"
        )
    return name, kwargs


def load_config(name_or_path: str | os.PathLike[str], **hf_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``(config, kwargs for the model's from_pretrained)``, as transformers' Auto classes split them:
    the hub keywords (``gguf_file`` included) go to both, config attributes are consumed here."""
    import transformers

    kwargs = dict(hf_kwargs)  # (hf_kwargs itself stays as given)
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) == "auto":  # meaningless for a config
            kwargs.pop(key)
    kwargs.pop("quantization_config", None)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    config, unused = transformers.AutoConfig.from_pretrained(name_or_path, return_unused_kwargs=True, **hub, **kwargs)
    for key in ("dtype", "torch_dtype", "quantization_config"):  # the model honours these over the config's
        if hf_kwargs.get(key) is not None:
            unused[key] = hf_kwargs[key]
    return config, {**unused, **hub}


def from_pretrained(name_or_path: str | os.PathLike[str], fused: bool | None = None, **hf_kwargs: Any) -> nn.Module:
    """Load ``name_or_path`` (hub id, local directory or ``.gguf`` file) with transformers and :func:`patch` it.

    ``hf_kwargs`` go to ``from_pretrained`` (``torch_dtype``/``dtype``, ``device_map``,
    ``attn_implementation``, ``gguf_file``, ...). ``model_class=`` picks the transformers class
    explicitly; otherwise the config (read once, ``gguf_file`` included) names it.

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) a missing folder or file, or a hub id
            that is neither cached nor reachable (:func:`resolve_checkpoint`).
    """
    model_class = hf_kwargs.pop("model_class", None)
    name_or_path, hf_kwargs = resolve_checkpoint(name_or_path, **hf_kwargs)
    if model_class is None:
        config = hf_kwargs.pop("config", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            config, hf_kwargs = load_config(config or name_or_path, **hf_kwargs)
        model_class = model_class_for(config)
        hf_kwargs["config"] = config
    model = load_upstream(model_class, name_or_path, **hf_kwargs)
    return patch(model, fused=fused)
