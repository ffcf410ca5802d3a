"""The replica check's chunk digest: dtype, shape and SAMPLES evenly spaced elements."""

from __future__ import annotations

import hashlib

import torch

from dcp_ext.planning.replica_check import SAMPLES, chunk_digest


def _direct_digest(tensor: torch.Tensor) -> bytes:
    """The digest as its docstring defines it, computed here from scratch."""
    flat = tensor.reshape(-1)
    positions = torch.linspace(0, flat.numel() - 1, SAMPLES, dtype=torch.float64).long()
    data = flat[positions].contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + data, digest_size=16).digest()


def test_digests_of_large_chunks_sample_the_same_positions_every_time():
    """Sample positions are made once per chunk size and reused: every digest equals one
    computed from scratch, for several sizes, in any order, repeatedly."""
    tensors = [torch.randn(n, 1024) for n in (2, 7, 64, 2, 7)] + [torch.randn(3000).to(torch.bfloat16)]
    for tensor in tensors + tensors:
        assert chunk_digest(tensor) == _direct_digest(tensor)


def test_a_changed_sampled_element_or_shape_changes_the_digest():
    tensor = torch.randn(64, 1024)
    changed = tensor.clone()
    changed.view(-1)[-1] += 1  # the last element is always sampled
    assert chunk_digest(changed) != chunk_digest(tensor)
    assert chunk_digest(tensor.reshape(1024, 64)) != chunk_digest(tensor)
    assert chunk_digest(tensor.clone()) == chunk_digest(tensor)


def test_every_dtype_is_sampled_by_its_bit_patterns():
    """torch has no CPU take kernel for float8 or uint16/32/64: a chunk of over SAMPLES
    elements of those failed every ShardSavePlanner save (stock DCP saves them)."""
    base = torch.randn(40, 60)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.bool,
                  torch.bfloat16, torch.complex64, torch.float64):
        tensor = base.to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
        for view in (tensor, tensor.t()):  # non-contiguous too
            assert chunk_digest(view) == _direct_digest(view), (dtype, view.stride())
