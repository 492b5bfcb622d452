import pytest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name) -> path`` of a tiny random-weight checkpoint, written once per session."""
    from torchembed.tools.checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return lambda name: build_checkpoint(name, root)


@pytest.fixture(scope="session")
def load(checkpoint):
    """``load(name, **hf_kwargs) -> model`` in eval mode, loaded with ``from_pretrained``."""
    from torchembed.patches.loading import load_upstream, model_class_for

    def _load(name, **kwargs):
        path = checkpoint(name)
        config = transformers.AutoConfig.from_pretrained(path)
        return load_upstream(model_class_for(config), path, **kwargs).eval()

    return _load


@pytest.fixture
def decode_masks_built(monkeypatch):
    """A list that grows by one each time the ALiBi attention builds a decode-step SDPA mask."""
    import torchembed.kernels.alibi as kernel  # the one place that builds it

    built = []
    original = kernel.alibi_decode_bias
    monkeypatch.setattr(kernel, "alibi_decode_bias", lambda *a: built.append(1) or original(*a))
    return built
