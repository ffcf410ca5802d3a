"""``torch_record.host_bytes``: a tensor's or storage's bytes by address, without a torch
operator (each gives up the GIL), holding the memory for as long as the view lives."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from dcp_ext.formats.torch_record import host_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn])
def test_writes_land_in_the_tensor_and_its_views(dtype):
    base = torch.zeros(6, 8, dtype=dtype)
    rows = base[2:4]  # a contiguous view at a storage offset
    values = torch.arange(16, dtype=torch.float32).to(dtype).reshape(2, 8)
    host_bytes(rows)[:] = values.view(torch.uint8).reshape(-1).numpy().tobytes()
    assert torch.equal(base[2:4].view(torch.uint8), values.view(torch.uint8))
    assert not base[:2].view(torch.uint8).any() and not base[4:].view(torch.uint8).any()
    storage = host_bytes(base.untyped_storage())
    assert storage.nbytes == base.nbytes and bytes(storage) == base.view(torch.uint8).reshape(-1).numpy().tobytes()


def test_the_view_keeps_the_memory_alive():
    tensor = torch.arange(1 << 16, dtype=torch.int32)
    view = host_bytes(tensor)
    del tensor
    gc.collect()
    torch.empty(1 << 16, dtype=torch.int32).fill_(-1)  # would reuse freed memory
    assert np.array_equal(np.frombuffer(view, np.int32), np.arange(1 << 16, dtype=np.int32))


def test_a_strided_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        host_bytes(torch.zeros(4, 4).t())


def test_memory_off_the_cpu_is_refused():
    with pytest.raises(ValueError, match="meta"):
        host_bytes(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        host_bytes(torch.empty(4, device="meta").untyped_storage())
