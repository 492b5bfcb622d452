"""Tools: numerics comparison against upstream (``compare``) and speed (``bench``)."""
