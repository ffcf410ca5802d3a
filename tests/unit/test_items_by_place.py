"""``ItemsByPlace`` answers every lookup as the dict of ``MetadataIndex`` keys it replaces.

A pickled ``.metadata``'s stored items are held by (fqn, offset) tuples instead of
``MetadataIndex`` keys (a dataclass: Python hash and equality). The reference is the dict
DCP's own unpickled ``storage_data`` is, built from the same indices.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.validate import ItemsByPlace

STORED = [
    (MetadataIndex("w", torch.Size([0, 0]), 0), StoredItem("__0_0.distcp", 0, 100)),
    (MetadataIndex("w", torch.Size([4, 0]), 1), StoredItem("__1_0.distcp", 0, 100)),
    (MetadataIndex("step"), StoredItem("__0_0.distcp", 100, 10)),  # a bytes item: no offset
    (MetadataIndex("b", torch.Size([0])), StoredItem("__0_0.distcp", 110, 40)),
]

ASKED = [
    MetadataIndex("w", torch.Size([0, 0])),  # no index hint
    MetadataIndex("w", torch.Size([4, 0]), 7),  # a wrong hint: neither hashed nor compared
    MetadataIndex("w", [4, 0]),  # offsets as a list: the constructor makes them a torch.Size
    MetadataIndex("step"),
    MetadataIndex("step", index=3),
    MetadataIndex("b", torch.Size([0])),
    MetadataIndex("b", torch.Size([1])),  # absent: another offset
    MetadataIndex("w", torch.Size([0])),  # absent: another number of dims
    MetadataIndex("x"),  # absent key
]


def _both() -> tuple[ItemsByPlace, dict[MetadataIndex, StoredItem]]:
    by_place = ItemsByPlace()
    for index, item in STORED:
        by_place.add(index, item)
    return by_place, dict(STORED)


def test_lookups_answer_as_a_dict_of_indices_does():
    by_place, reference = _both()
    for index in ASKED:
        assert (index in by_place) == (index in reference), index
        assert by_place.get(index) is reference.get(index), index
        assert by_place.get(index, "none") is reference.get(index, "none"), index
        if index in reference:
            assert by_place[index] is reference[index]
        else:
            with pytest.raises(KeyError):
                by_place[index]


def test_iteration_length_and_objects_not_indices():
    by_place, reference = _both()
    assert len(by_place) == len(reference) == 4
    assert list(by_place) == list(reference)  # the stored indices themselves, in order
    assert all(a is b for a, b in zip(by_place, reference))
    assert dict(by_place.items()) == reference
    for other in ("w", ("w", torch.Size([0, 0])), None):  # not an index: absent, as from a dict of indices
        assert other not in by_place
        assert by_place.get(other) is None
        with pytest.raises(KeyError):
            by_place[other]  # type: ignore[index]


def test_at_takes_the_place_without_an_index():
    by_place, reference = _both()
    for index in ASKED:
        offset = None if index.offset is None else tuple(index.offset)  # a tuple finds what its torch.Size does
        assert by_place.at(index.fqn, index.offset) is reference.get(index), index
        assert by_place.at(index.fqn, offset) is reference.get(index), index
