"""State staged a chunk at a time from CUDA (``ChunkedStaging``): one pinned
host buffer of one chunk, and the same values as staging the state whole."""

from __future__ import annotations

import torch

from averaging import ChunkedStaging, HostStaging


def test_cuda_state_goes_through_one_pinned_chunk_buffer(cuda: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)  # drawn on the CPU: the same on every GPU
    state = [
        torch.randn(5000, generator=gen).to(cuda),
        torch.randn(64, 33, generator=gen).to(cuda).to(torch.bfloat16),
        torch.randn(40, 50, generator=gen).to(cuda).t(),  # not contiguous: one piece
    ]
    whole = HostStaging([t.clone() for t in state]).to_host()
    staging = ChunkedStaging(state, 1024)
    assert staging.buffer.is_pinned() and staging.buffer.numel() == 2000
    pieces = []
    for k in range(len(staging)):
        pieces += [h.clone().reshape(-1) for h in staging.to_host(k)]
        for h in staging.to_host(k):
            h.add_(1.0)
        staging.from_host(k)
    torch.testing.assert_close(
        torch.cat(pieces), torch.cat([w.reshape(-1) for w in whole]), atol=0, rtol=0
    )
    torch.cuda.synchronize(cuda)
    for t, w in zip(state, whole, strict=True):
        torch.testing.assert_close(t.cpu().float(), (w + 1.0).to(t.dtype).float(), atol=0, rtol=0)
