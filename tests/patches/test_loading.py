"""Loading: a missing hub-kernels package never stops torchembed's loaders (transformers 5.25 turns
hub kernels on by default and raises without the ``kernels`` package)."""

import pytest

import torchembed
from torchembed.patches import loading

transformers = pytest.importorskip("transformers")


class _Recorder:
    """A model class whose ``from_pretrained`` records its keyword arguments."""

    seen: list = []

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.seen.append(kwargs)
        return kwargs


@pytest.mark.parametrize("installed, given, expected", [
    (False, {}, False),                       # no kernels package: off, as every release before 5.25
    (True, {}, None),                         # installed: transformers decides (its release's default)
    (False, {"use_kernels": True}, True),     # the caller's choice is kept either way
    (True, {"use_kernels": False}, False),
])
def test_load_upstream_turns_hub_kernels_off_only_when_the_package_is_missing(installed, given, expected, monkeypatch):
    monkeypatch.setattr(loading, "_hub_kernels_installed", lambda: installed)
    _Recorder.seen = []
    kwargs = loading.load_upstream(_Recorder, "folder", dtype="auto", **given)
    assert kwargs.get("use_kernels") == expected and kwargs["dtype"] == "auto"


def test_from_pretrained_loads_without_the_hub_kernels_switch(checkpoint, monkeypatch):
    """No ``USE_HUB_KERNELS`` in the environment: on 5.25 without ``kernels`` plain transformers raises
    here; torchembed's loader does not."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    model = torchembed.from_pretrained(checkpoint("llama"))
    assert torchembed.is_patched(model)


def test_hub_kernels_check_follows_transformers():
    from transformers.utils import import_utils

    assert loading._hub_kernels_installed() == bool(import_utils.is_kernels_available())
