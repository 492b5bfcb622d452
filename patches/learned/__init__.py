"""The learned absolute position patches: :mod:`.families` holds BERT and GPT-2 (the position table becomes
torchembed's, the same weight Parameter) and registers them when imported.
"""
