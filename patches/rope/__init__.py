"""The RoPE patch pipeline: :mod:`.recognition` probes an upstream rotation helper once and records how it rotates
(:class:`~torchembed.patches.rope.recognition.Rotation`); :mod:`.helper` is torchembed's drop-in for one recognised
helper (:class:`~torchembed.patches.rope.helper.RotaryHelper`); :mod:`.decode_attention` serves a patched model's SDPA
decode steps on the attention kernel; :mod:`.families` finds the rotating attentions of a model by structure, rebuilds
their forwards with those replacements, registers the RoPE families and installs the registry's fallback (importing
it registers them).
"""
