"""The one-pass ALiBi prefill bias kernel (``prefill_bias``) against its PyTorch reference and float64."""

import pytest
import torch

from torchembed.functional.alibi import alibi_key_bias, alibi_prefill_bias, alibi_slopes
from torchembed.kernels import alibi as alibi_bias
from torchembed.kernels import route
from torchembed.kernels.alibi import prefill_bias

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, h, q_len, k_len, pad, *, bias_batch=True, keep_batch=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, k_len, dtype=torch.long)
    mask[0, :pad] = 0
    # random slopes of ALiBi's size, scaled: values of hundreds, where bfloat16 rounds in steps of 2-4
    slopes = alibi_slopes(h) * (1 + torch.rand(h, generator=gen)) * 40
    key_bias = alibi_key_bias(slopes, mask).to(DEV)
    positions = torch.arange(k_len)
    keep = (positions[None, :] <= positions[k_len - q_len :, None])[None, None] & mask.bool()[:, None, None, :]
    key_bias = key_bias if bias_batch else key_bias[:1]
    keep = keep if keep_batch else keep[:1]
    return key_bias, keep.to(DEV)


def _float64(key_bias, keep, dtype):
    q_len, k_len = keep.shape[-2:]
    kb = key_bias.double()
    diff = kb[:, :, None, :] - kb[:, :, k_len - q_len :, None]
    return diff.masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b, h, q_len, k_len, pad, bias_batch, keep_batch",
    [
        (2, 3, 40, 40, 2, True, True),  # square prefill, left padding
        (2, 4, 5, 300, 0, False, False),  # chunked prefill after a cache: 5 queries over 300 keys, tile edges
        (3, 2, 17, 33, 4, False, True),  # one key bias for the batch, a padded mask per row
        (1, 1, 1, 1, 0, True, True),  # one element
    ],
)
def test_equals_the_reference_and_float64(dtype, b, h, q_len, k_len, pad, bias_batch, keep_batch):
    key_bias, keep = _case(b, h, q_len, k_len, pad, bias_batch=bias_batch, keep_batch=keep_batch)
    got = prefill_bias(key_bias, keep, dtype)
    want = alibi_prefill_bias(key_bias, keep, dtype)
    assert got.dtype == dtype and got.shape == (max(key_bias.shape[0], keep.shape[0]), h, q_len, k_len)
    assert got.is_contiguous()
    # both subtract in float32 and round once: equal to the bit
    assert torch.equal(got, want.expand_as(got))
    # and within one rounding of dtype (plus float32's on the subtraction) of the float64 value
    truth = _float64(key_bias, keep, dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), truth.expand_as(got), rtol=eps, atol=1e-5)


def test_any_strides():
    """A key bias with a non-unit last stride and a transposed keep mask give the contiguous result."""
    key_bias, keep = _case(2, 3, 24, 24, 3)
    wide = torch.zeros(2, 3, 24, 2, device=DEV)
    wide[..., 0] = key_bias
    strided_bias = wide[..., 0]  # stride (144, 48, 2)
    strided_keep = keep.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert strided_bias.stride(-1) == 2 and strided_keep.stride(-1) != 1
    got = prefill_bias(strided_bias, strided_keep, torch.bfloat16)
    assert torch.equal(got, alibi_prefill_bias(key_bias, keep, torch.bfloat16))


def test_every_element_written_where_masked():
    """Rows that keep no key (a left-padded query) hold the finite minimum throughout, never NaN."""
    key_bias, keep = _case(2, 2, 12, 12, 5)
    got = prefill_bias(key_bias, keep, torch.bfloat16)
    assert (got[0, :, :5] == torch.finfo(torch.bfloat16).min).all()
    assert torch.isfinite(got).all()


def test_falls_back_to_the_reference():
    """float64 results and the one-row form (no mask) take the PyTorch reference."""
    key_bias, keep = _case(2, 2, 8, 8, 0)
    assert torch.equal(prefill_bias(key_bias, keep, torch.float64), alibi_prefill_bias(key_bias, keep, torch.float64))
    assert torch.equal(prefill_bias(key_bias, None, torch.float32), alibi_prefill_bias(key_bias, None, torch.float32))


@pytest.mark.parametrize(
    "key_bias_shape, keep_shape",
    [((2, 3, 8), (2, 2, 8, 8)), ((2, 3, 8), (2, 1, 8, 9)), ((2, 3, 8), (3, 1, 8, 8)), ((3, 8), (1, 1, 8, 8)),
     ((1, 3, 8), (1, 1, 9, 8))],
)
def test_bad_shapes_name_what_was_expected(key_bias_shape, keep_shape):
    with pytest.raises(ValueError, match=r"prefill_bias: .*\(b or 1"):
        prefill_bias(torch.zeros(key_bias_shape, device=DEV), torch.ones(keep_shape, dtype=torch.bool, device=DEV),
                     torch.float32)


def test_custom_op_registration():
    """The op (what torch.compile sees) passes torch.library's checks: schema, fake impl, dispatch."""
    key_bias, keep = _case(2, 2, 6, 10, 1)
    torch.library.opcheck(torch.ops.torchembed.alibi_prefill_bias.default, (key_bias, keep, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.torchembed.alibi_prefill_bias(key_bias, keep, torch.bfloat16)
    assert torch.equal(out, alibi_prefill_bias(key_bias, keep, torch.bfloat16))


def test_batch_times_heads_beyond_the_grid_takes_the_reference(monkeypatch):
    monkeypatch.setattr(route, "_MAX_PROGRAMS", 3)
    key_bias, keep = _case(2, 2, 4, 4, 0)
    launched = []
    monkeypatch.setattr(alibi_bias, "_write_bias", lambda *a: launched.append(1))
    out = prefill_bias(key_bias, keep, torch.float32)
    assert not launched and torch.equal(out, alibi_prefill_bias(key_bias, keep, torch.float32))


def test_launches_are_kept_and_repeated_directly_on_cuda(monkeypatch):
    """The first launch goes through Triton and is kept (``alibi._BIAS_LAUNCHES``, on every device); a
    call with the same arguments but pointers repeats it, with the same result: on CUDA through the
    compiled kernel's launcher (no ``kernel[grid]``), on the interpreter through ``kernel[grid]`` each time."""
    import torchembed.kernels.alibi_triton as triton_module
    from torchembed.kernels.settings import settings

    calls = []
    original = triton_module.prefill_bias_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return original[grid]

    monkeypatch.setattr(triton_module, "prefill_bias_kernel", Counting())
    launches = alibi_bias._BIAS_LAUNCHES
    launches.clear()  # (kept launches hold the kernel they were set up with)
    try:
        key_bias, keep = _case(2, 3, 40, 40, 2)
        first = prefill_bias(key_bias, keep, torch.bfloat16)
        other_bias = key_bias * 0.5  # same shapes and strides, other values and pointers
        second = prefill_bias(other_bias, keep, torch.bfloat16)
        assert torch.equal(first, alibi_prefill_bias(key_bias, keep, torch.bfloat16))
        assert torch.equal(second, alibi_prefill_bias(other_bias, keep, torch.bfloat16))
        assert len(launches) == 1
        if DEV == "cuda":
            assert len(calls) == 1 and settings().direct_launch
        else:
            assert len(calls) == 2
        third = prefill_bias(key_bias[:1], keep, torch.bfloat16)  # another shape: Triton again, kept too
        assert torch.equal(third, alibi_prefill_bias(key_bias[:1], keep, torch.bfloat16))
        assert len(launches) == 2 and len(calls) == (2 if DEV == "cuda" else 3)
    finally:
        launches.clear()
