"""Tools: numerics comparison against upstream (``compare``), speed (``bench``), tiny random-weight
checkpoints (``checkpoints``) and multi-process launches with a time limit (``launch``)."""
