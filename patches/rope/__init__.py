"""The RoPE patch pipeline: :mod:`.recognition` probes an upstream rotation helper once and records how it rotates,
:mod:`.helper` is torchembed's drop-in for one recognised helper, :mod:`.decode_attention` serves a patched model's SDPA
decode steps on the attention kernel, and :mod:`.families` finds a model's rotating attentions by structure, rebuilds
their forwards with those replacements and registers the RoPE families and the registry's fallback when imported.
"""
