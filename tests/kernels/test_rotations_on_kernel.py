"""The rotations beyond HF's usual helper (complex frequencies, vision towers, M-RoPE) on the fused
kernel: Triton's interpreter on the CPU, the GPU on CUDA machines (``tests/patches/test_rotations.py``
checks them on the PyTorch path)."""

import pytest

from torchembed import kernels

pytest.importorskip("transformers")
from tests.patches import test_rotations as rotations  # noqa: E402

if not kernels.triton_available():
    pytest.skip("triton is not importable", allow_module_level=True)


@pytest.mark.parametrize("name", list(rotations.MODELS))
def test_patched_model_on_the_kernel_matches_upstream(name):
    rotations.test_patched_matches_upstream_and_never_calls_its_helper(name)  # asserts the kernel launches
