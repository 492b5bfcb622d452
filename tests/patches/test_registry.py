"""Meta-tests: the registry, the adapters and the embedded checkpoints agree."""

import pytest

import torchembed
from torchembed.patches.registry import REGISTRY, resolve, supported_families
from torchembed.tools.checkpoints import TINY_MODELS, tiny_config

FAMILIES = {"llama", "mistral", "falcon", "bloom", "mpt", "bert", "gpt2"}


def test_registry_covers_the_seven_families():
    assert set(REGISTRY) == FAMILIES


def test_every_tiny_model_resolves_to_a_family():
    for name in TINY_MODELS:
        assert resolve(tiny_config(name)) is not None, name


def test_every_family_has_a_tiny_model():
    covered = {resolve(tiny_config(name)).name for name in TINY_MODELS}
    assert covered == {f.name for f in supported_families()}


def test_falcon_variant_follows_config():
    assert resolve(tiny_config("falcon")).encoding == "rope"
    assert resolve(tiny_config("falcon-alibi")).encoding == "alibi"


def test_public_api_is_reexported():
    for name in ("patch", "unpatch", "is_patched", "patched", "find_positional_components", "from_pretrained", "compare"):
        assert callable(getattr(torchembed, name))
    with pytest.raises(AttributeError):
        torchembed.not_a_thing
