"""The four positional encodings (the API of ``torchembed.positional``)."""

from torchembed.positional.alibi import ALiBiEmbedding
from torchembed.positional.learned import LearnedPositionalEmbedding
from torchembed.positional.rotary import RotaryEmbedding
from torchembed.positional.sinusoidal import SinusoidalEmbedding

__all__ = ["RotaryEmbedding", "ALiBiEmbedding", "SinusoidalEmbedding", "LearnedPositionalEmbedding"]
