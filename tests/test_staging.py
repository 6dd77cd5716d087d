"""The host staging layer and the codec boundary: device tensors reach the wire
only through ``HostStaging``; anything else is a local, typed error."""

from __future__ import annotations

import pytest
import torch

from averaging import NONE, UINT8, HostStaging, LocalTensorError, float32_accumulators
from averaging._codecs import encode, encode_split
from averaging._partition import flatten


def test_float32_accumulators_are_one_vector_per_device_whatever_the_dtype() -> None:
    params = [torch.ones(3, 2, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float16)]
    accs = float32_accumulators(params)
    assert [a.dtype for a in accs] == [torch.float32, torch.float32]
    assert [a.shape for a in accs] == [p.shape for p in params]
    assert accs[1].data_ptr() == accs[0].data_ptr() + 4 * 6  # back to back
    staging = HostStaging(accs)
    assert not staging.copies and staging.host == accs  # a CPU model copies nothing
    assert staging.to_host() is staging.host


def test_staging_copies_other_dtypes_to_float32_and_back() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 3, dtype=torch.float16)]
    staging = HostStaging(tensors)
    assert staging.copies and not staging.pinned  # nothing to pin for on a CPU machine
    host = staging.to_host()
    assert [h.dtype for h in host] == [torch.float32, torch.float32]
    for h, t in zip(host, tensors, strict=True):
        assert torch.equal(h, t.float())
    # the buffer is reused: a second copy lands in the same memory
    before = staging.buffer.data_ptr()
    for h in staging.to_host():
        h.mul_(2)
    assert staging.buffer.data_ptr() == before
    expected = [t.float() * 2 for t in tensors]
    staging.from_host()
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e.to(t.dtype))


def test_staging_copies_separate_float32_tensors_through_one_buffer() -> None:
    tensors = [torch.arange(4, dtype=torch.float32), torch.arange(3, dtype=torch.float32)]
    staging = HostStaging(tensors)
    assert staging.copies
    host = staging.to_host()
    host[0].fill_(7)
    assert tensors[0].tolist() == [0, 1, 2, 3]  # nothing written back yet
    staging.from_host()
    assert tensors[0].tolist() == [7, 7, 7, 7]


def test_staging_refuses_tensors_that_cannot_be_averaged() -> None:
    with pytest.raises(LocalTensorError, match="floating point"):
        HostStaging([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.parametrize("codec", [NONE, UINT8])
def test_the_codec_boundary_accepts_only_cpu_tensors(codec: object) -> None:
    # "meta" stands in for any device tensor (cuda, mps) on a CPU-only machine
    device_tensor = torch.zeros(8, device="meta")
    with pytest.raises(LocalTensorError, match="only CPU tensors go on the wire"):
        encode(device_tensor, codec)  # type: ignore[arg-type]
    with pytest.raises(LocalTensorError, match="only CPU tensors"):
        encode_split(device_tensor, codec)  # type: ignore[arg-type]
    # bfloat16 on the CPU is fine: it is converted to float32 on the way
    assert encode(torch.ones(8, dtype=torch.bfloat16), NONE) == encode(torch.ones(8), NONE)


def test_the_all_reduce_refuses_device_tensors_before_sending_anything() -> None:
    # all_reduce flattens first: a device tensor fails here, in the local peer
    with pytest.raises(LocalTensorError):
        flatten([torch.zeros(2), torch.zeros(3, device="meta")])
    with pytest.raises(ValueError):  # LocalTensorError is a ValueError, as before
        flatten([torch.zeros(2, dtype=torch.int32)])
