"""The ALiBi patches: :mod:`.families` holds BLOOM, MPT and Falcon with ``alibi=True`` (torchembed's slopes, bias and
attention, per instance) and registers them when imported.
"""
