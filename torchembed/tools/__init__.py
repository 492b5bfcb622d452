"""Tools: numerics comparison against upstream (``compare``), speed (``bench``), tiny random-weight
checkpoints (``checkpoints``), multi-process launches with a time limit (``launch``) and a pytest plugin
that patches every model a test session builds (``patch_every_model``: transformers' own model tests on
patched models)."""
