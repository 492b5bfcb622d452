"""The pytest plugin that patches every model a test session builds (``-p torchembed.tools.patch_every_model``),
run in a pytest of its own on a test file written here, as transformers' own model tests would use it."""

import pytest

pytest.importorskip("transformers")
pytest_plugins = ["pytester"]

PLUGIN = "torchembed.tools.patch_every_model"

# Models built as transformers' model tests build them: from a config, and through from_pretrained
# (an outer model holding an inner one whose own post_init runs first).
INNER_TESTS = '''
import torch
import transformers

import torchembed

def _llama_config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

def test_causal_lm_is_patched_whole():
    model = transformers.LlamaForCausalLM(_llama_config())
    assert torchembed.is_patched(model)
    assert not torchembed.is_patched(model.model)  # the inner LlamaModel was not patched on its own, before

def test_from_pretrained_is_patched_and_keeps_the_weights(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert torchembed.is_patched(loaded)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name

def test_a_model_without_positional_components_is_left_as_built():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
    assert not torchembed.is_patched(transformers.MambaModel(config))
'''


def _summary(result) -> str:
    return next(line for line in result.outlines if line.startswith("torchembed: "))


def test_every_model_built_is_patched_once_whole(pytester):
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    # 4 models: 2 llama built, 1 loaded (the inner LlamaModels are parts, not models of their own), 1 mamba
    assert _summary(result) == "torchembed: 4 models built, 3 patched, 1 left unpatched (nothing torchembed swaps)"


def test_the_session_ends_with_the_plugin_removed(pytester):
    pytester.makepyfile(test_inner='''
import transformers

def test_build():
    transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64))
''')
    pytester.makeconftest('''
import pytest
import transformers

ORIGINAL = (transformers.PreTrainedModel.__init__, transformers.PreTrainedModel.post_init)

@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):  # after the plugin's: the classes are upstream's again
    assert (transformers.PreTrainedModel.__init__, transformers.PreTrainedModel.post_init) == ORIGINAL
    print("torchembed-test: restored")
''')
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    assert _summary(result) == "torchembed: 1 models built, 1 patched, 0 left unpatched (nothing torchembed swaps)"
    assert "torchembed-test: restored" in result.stdout.str()


def test_without_the_plugin_the_same_tests_fail(pytester):
    """The inner tests can fail: unpatched, the two that expect a patched model do."""
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    assert not any(line.startswith("torchembed: ") for line in result.outlines)


@pytest.mark.slow
def test_under_xdist_the_workers_counts_are_summed(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=3)
    assert _summary(result) == "torchembed: 4 models built, 3 patched, 1 left unpatched (nothing torchembed swaps)"
