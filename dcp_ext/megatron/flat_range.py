"""Split a flattened range of a row-major block into N-D boxes.

Megatron's distributed optimizer (up to v0.14) saved each rank's slice of a parameter
as a range of the *flattened* local shard. DCP chunks are boxes, so a range becomes the
few boxes it covers (a partial first row, whole rows, a partial last row, recursively).
Each box is contiguous in the flattened order, so it maps to one byte range on disk.
"""

from __future__ import annotations

from dcp_ext.formats.torch_record import numel

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of a row-major array of ``shape``, in order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = numel(shape[1:])
    rest = (0,) * (len(shape) - 1)
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        base = first_row * inner
        return [((first_row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start - base, stop - base)]
    boxes: list[Box] = []
    full_from, full_to = -(-start // inner), stop // inner  # rows covered completely
    if start % inner:
        boxes += [((first_row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start % inner, inner)]
    if full_to > full_from:
        boxes.append(((full_from, *rest), (full_to - full_from, *shape[1:])))
    if stop % inner:
        boxes += [((last_row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, stop % inner)]
    return boxes


def flat_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """Row-major position of the element at ``offsets``."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index
