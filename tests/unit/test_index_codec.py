"""The index codec without files: what ``encode_index`` writes ``decode_index`` gives back.

A hand-built ``Metadata`` (sharded and replicated tensors, a bytes item, an empty tensor)
with its stored items and TP-replica copies goes through the Parquet index and back;
every DCP object and stored location must equal the original, and broken bytes must be
refused as corruption, naming the source.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_ext.errors import CheckpointError, CorruptCheckpointError
from dcp_ext.formats import index as index_module
from dcp_ext.formats.index import StoredItem, decode_index, encode_index, ragged_take
from dcp_ext.planning import load_plan
from dcp_ext.planning.load_plan import tensor_reads


def chunk(offsets, sizes) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def checkpoint() -> tuple[Metadata, dict[MetadataIndex, StoredItem], dict[MetadataIndex, list[StoredItem]]]:
    """Metadata of a 2-rank save: ``w`` row-sharded, ``norm`` replicated (with a TP copy),
    ``empty`` with no elements, ``step`` a bytes item."""
    state = {
        "w": TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([5, 3]), [chunk([0, 0], [3, 3]), chunk([3, 0], [2, 3])]
        ),
        "norm": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([7]), [chunk([0], [7])]),
        "empty": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([0, 4]), [chunk([0, 0], [0, 4])]),
        "step": BytesStorageMetadata(),
    }
    metadata = Metadata(state, planner_data={"w": ("w",), "step": ("step",)}, storage_meta=StorageMeta(save_id="s1"))
    items = {
        MetadataIndex("w", [0, 0]): StoredItem("__0_0.distcp", 0, 900, 800, 11),
        MetadataIndex("w", [3, 0]): StoredItem("__1_0.distcp", 0, 700, 600, 12),
        MetadataIndex("norm", [0]): StoredItem("__0_0.distcp", 900, 600, 1000, 13, ("zstd",)),
        MetadataIndex("empty", [0, 0]): StoredItem("__0_0.distcp", 1500, 500, -1, 14),
        MetadataIndex("step"): StoredItem("__1_0.distcp", 700, 40, -1, 15),
    }
    copies = {MetadataIndex("norm", [0]): [StoredItem("__1_0.distcp", 740, 600, 840, 13, ("zstd",))]}
    return metadata, items, copies


def encoded() -> tuple[bytes, Metadata, dict, dict, bytes]:
    metadata, items, copies = checkpoint()
    metadata_bytes = pickle.dumps(metadata)
    return encode_index(metadata, items, metadata_bytes, 1234, copies), metadata, items, copies, metadata_bytes


@pytest.mark.parametrize("whole_read_rows", [65_536, 0], ids=["one-read", "column-by-column"])
def test_round_trip_gives_back_every_object_and_location(whole_read_rows, monkeypatch):
    """Both ways of reading the table: small indexes in one call, large ones a column at a time."""
    monkeypatch.setattr(index_module, "_WHOLE_READ_ROWS", whole_read_rows)
    data, metadata, items, copies, metadata_bytes = encoded()
    back = decode_index(data, "ckpt/.index")
    assert back.metadata_crc32c == 1234 and back.metadata_size == len(metadata_bytes)
    assert back.metadata.state_dict_metadata == metadata.state_dict_metadata
    assert back.metadata.planner_data == metadata.planner_data
    assert back.metadata.storage_meta.save_id == "s1"
    assert dict(back.items) == items
    assert {k: list(v) for k, v in back.copies.items()} == copies
    assert back.metadata.storage_data == {index: item.storage_info() for index, item in items.items()}


def test_a_chunk_with_other_dims_than_its_tensor_is_refused_by_key():
    """The writer flattens every box into one column: a chunk of the wrong length would
    shift every later key's boxes, so it is refused, naming its key."""
    for first, second in (((0, 0), (3,)), ((0, 0, 0), (3,))):  # one short; one long and one short (same total)
        metadata, items, copies = checkpoint()
        metadata.state_dict_metadata["w"].chunks[:] = [chunk(first, [3, 3]), chunk(second, [2, 3])]
        with pytest.raises(CheckpointError, match=r"key 'w': a chunk's offsets or sizes do not have the tensor's 2 dimensions"):
            encode_index(metadata, items, pickle.dumps(metadata), 1, copies)


def test_lookups_follow_dcp_index_equality():
    back = decode_index(encoded()[0], "ckpt/.index")
    assert back.items[MetadataIndex("w", [3, 0], index=0)].relative_path == "__1_0.distcp"  # the hint does not count
    with pytest.raises(KeyError):
        back.items[MetadataIndex("w", [1, 0])]


@pytest.mark.parametrize("hint", [None, 0, 1, 2, -1, 99])
def test_a_chunk_hint_is_checked_before_it_is_trusted(hint):
    """``MetadataIndex.index`` (where DCP's planners say a chunk stands in its key's list)
    spares the search among a key's rows: right, wrong or out of range, every lookup
    finds the same row, an offset with no chunk stays missing, and TP-replica copies
    (several rows at one offset) are all found."""
    for offset, path, sizes in (([0, 0], "__0_0.distcp", (3, 3)), ([3, 0], "__1_0.distcp", (2, 3))):
        back = decode_index(encoded()[0], "ckpt/.index")  # fresh: nothing remembered
        assert back.items[MetadataIndex("w", offset, index=hint)].relative_path == path
        back = decode_index(encoded()[0], "ckpt/.index")
        assert back.metadata.state_dict_metadata.chunk_shape("w", offset, hint) == (torch.bfloat16, sizes)
    back = decode_index(encoded()[0], "ckpt/.index")
    with pytest.raises(KeyError):
        back.items[MetadataIndex("w", [1, 0], index=hint)]
    assert [c.relative_path for c in back.copies[MetadataIndex("norm", [0], index=hint)]] == ["__1_0.distcp"]


def test_remembered_chunk_lookups_stay_bounded_and_right(monkeypatch):
    """Lookups are remembered per catalog (a load asks for each chunk twice), at most
    FIND_MEMO_ENTRIES of them: a whole-checkpoint load in one process stays bounded."""
    monkeypatch.setattr(index_module, "FIND_MEMO_ENTRIES", 2)
    back = decode_index(encoded()[0], "ckpt/.index")
    keys = back.metadata.state_dict_metadata
    for _ in range(3):
        for offset, sizes in (([0, 0], (3, 3)), ([3, 0], (2, 3)), ([1, 0], None)):
            found = keys.chunk_shape("w", offset)
            assert (found and found[1]) == sizes
            assert (MetadataIndex("w", offset) in back.items) == (sizes is not None)
        assert keys.chunk_shape("norm", [0]) == (torch.float32, (7,))
        assert keys.chunk_shape("step", None) is None
        assert len(back.items._rows._found) <= 2


@pytest.mark.parametrize("cut", [0, 8, 100, -8])
def test_broken_bytes_are_corruption_naming_the_source(cut):
    data = encoded()[0]
    broken = data[:cut] if cut > 0 else data[cut:] if cut < 0 else b""
    with pytest.raises(CorruptCheckpointError, match="ckpt/.index"):
        decode_index(broken, "ckpt/.index")


def test_a_flipped_byte_never_decodes_to_other_values():
    data = encoded()[0]
    for position in range(0, len(data), max(1, len(data) // 97)):
        flipped = bytearray(data)
        flipped[position] ^= 0xFF
        try:
            back = decode_index(bytes(flipped), "ckpt/.index")
            found = dict(back.items)  # a key's rows are checked when it is first used
        except CorruptCheckpointError:
            continue
        # Parquet pages carry no checksum of their own: what decodes must be sane, and the
        # marker's CRC of the index (checked by the reader) catches the rest
        for item in found.values():
            assert item.offset >= 0 and item.length >= 0 and item.relative_path.endswith(".distcp"), (position, item)


@pytest.mark.parametrize("rows", [[0, 2, 3], [0, 3], [2], []])
def test_ragged_take_is_each_rows_values_back_to_back(rows):
    values, start, length = np.arange(100, 110), np.array([0, 2, 2, 5]), np.array([2, 0, 3, 5])
    rows = np.array(rows, np.int64)
    got = ragged_take(values, start[rows], length[rows])
    assert got.tolist() == [v for r in rows.tolist() for v in values[start[r] : start[r] + length[r]].tolist()]


def rewritten(data: bytes, change) -> bytes:
    """The index ``data`` with its rows (a dict of column lists) passed through ``change``."""
    table = pq.read_table(io.BytesIO(data))
    rows = table.to_pydict()
    change(rows)
    sink = io.BytesIO()
    pq.write_table(pa.table(rows, schema=table.schema), sink)
    return sink.getvalue()


def test_rows_in_another_order_give_back_the_same_objects():
    """Another writer may not group a key's rows: they are grouped on read (and gathered,
    not sliced), with the same objects and locations."""
    data, metadata, items, copies, _ = encoded()

    def move_first_row_last(rows):  # 'w' at [0, 0] after the copy row
        for values in rows.values():
            values.append(values.pop(0))

    back = decode_index(rewritten(data, move_first_row_last), "ckpt/.index")
    want = metadata.state_dict_metadata
    want["w"].chunks.reverse()  # chunks come in row order
    assert back.metadata.state_dict_metadata == want
    assert dict(back.items) == items and {k: list(v) for k, v in back.copies.items()} == copies


def set_values(**changes):
    """A change of the index rows: ``column=(row, value)`` each. Rows: 'w' [0, 0], 'w'
    [3, 0], 'norm', 'empty', 'step', then the copy of 'norm'."""

    def change(rows):
        for column, (row, value) in changes.items():
            rows[column][row] = value

    return change


ROW_FAULTS = {
    "chunk outside the tensor": (set_values(sizes=(1, [3, 3])), r"'w' chunk at \[3, 0\] of size \[3, 3\] does not fit"),
    "record too small": (set_values(length=(1, 10), payload_offset=(1, -1)), r"'w' chunk at \[3, 0\] needs 12 bytes"),
    "two rows at one offset": (set_values(offsets=(1, [0, 0])), r"'w' has two index rows at offset \[0, 0\]"),
}


@pytest.mark.parametrize("fault", list(ROW_FAULTS))
def test_a_faulty_key_is_refused_when_used_and_the_others_still_answer(fault):
    """A key's rows are checked the first time the key is used, on every path that reads them."""
    change, message = ROW_FAULTS[fault]
    data, metadata, items, _, _ = encoded()
    back = decode_index(rewritten(data, change), "ckpt/.index")
    keys = back.metadata.state_dict_metadata
    assert keys["norm"] == metadata.state_dict_metadata["norm"]
    assert back.items[MetadataIndex("norm", [0])] == items[MetadataIndex("norm", [0])]
    plan = lambda: tensor_reads(keys, [("norm", 0, chunk([0], [7])), ("w", 0, chunk([0, 0], [5, 3]))])
    for use in (lambda: keys["w"], lambda: keys.boxes("w"), lambda: back.items[MetadataIndex("w", [0, 0])], lambda: dict(back.items), plan):
        with pytest.raises(CorruptCheckpointError, match=message):
            use()


def test_a_copy_of_no_chunk_is_refused_when_copies_are_used():
    data, _, items, _, _ = encoded()
    back = decode_index(rewritten(data, set_values(offsets=(5, [1]), sizes=(5, [6]))), "ckpt/.index")
    assert back.items[MetadataIndex("norm", [0])] == items[MetadataIndex("norm", [0])]  # the canonical chunk is sound
    with pytest.raises(CorruptCheckpointError, match=r"replica copies of 'norm' have no canonical chunk"):
        back.copies[MetadataIndex("norm", [0])]


def test_one_chunk_keys_in_another_writers_row_order_are_checked_against_their_own_shapes():
    """Keys with one chunk are checked together at open; rows in another order than the
    keys (here b and c swapped) must still meet their own key's shape."""
    shapes = {"a": 2, "b": 5, "c": 3, "d": 4}
    state = {
        fqn: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n]), [chunk([0], [n])])
        for fqn, n in shapes.items()
    }
    metadata = Metadata(state, planner_data={fqn: (fqn,) for fqn in shapes})
    items = {MetadataIndex(fqn, [0]): StoredItem("__0_0.distcp", 100 * n, 100, -1, n) for n, fqn in enumerate(shapes)}
    data = encode_index(metadata, items, pickle.dumps(metadata), 1)

    def swap_b_and_c(rows):
        for values in rows.values():
            values[1], values[2] = values[2], values[1]

    back = decode_index(rewritten(data, swap_b_and_c), "ckpt/.index")
    assert dict(back.metadata.state_dict_metadata) == state
    assert dict(back.items) == items


def _grid(shape: list[int], rng: np.random.Generator) -> list[ChunkStorageMetadata]:
    """The chunks of a random grid over ``shape``: each dim cut at up to two points."""
    if not shape:
        return [chunk([], [])]
    cuts = [sorted({0, n, *rng.integers(1, n, size=rng.integers(0, 3)).tolist()}) if n > 1 else [0, n] for n in shape]
    spans = [list(zip(c[:-1], c[1:])) for c in cuts]
    boxes = np.array(np.meshgrid(*[np.arange(len(s)) for s in spans], indexing="ij")).reshape(len(shape), -1).T
    return [chunk([spans[d][i][0] for d, i in enumerate(box)], [spans[d][i][1] - spans[d][i][0] for d, i in enumerate(box)]) for box in boxes]


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_over_keys_of_every_ndim_with_rows_in_any_order_is_dcps(seed, monkeypatch):
    """Keys of 0 to 3 dims, each saved as a random grid, rows shuffled (another writer's
    order: a batch's rows are then gathered, never taken for a run), random local grids:
    the read items are DCP's own, whatever the batch size."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    rng = np.random.default_rng(seed)
    shapes = {f"k{n}": rng.integers(1, 9, size=n % 4).tolist() for n in range(12)}
    state = {fqn: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), _grid(shape, rng)) for fqn, shape in shapes.items()}
    items = {
        MetadataIndex(fqn, c.offsets): StoredItem("__0_0.distcp", 4096 * n, 4 * int(np.prod(c.sizes)), -1, n)
        for n, (fqn, c) in enumerate((fqn, c) for fqn, md in state.items() for c in md.chunks)
    }
    metadata = Metadata(state, planner_data={fqn: (fqn,) for fqn in shapes})
    order = rng.permutation(len(items))

    def shuffle(rows):
        for column, values in rows.items():
            rows[column] = [values[i] for i in order]

    back = decode_index(rewritten(encode_index(metadata, items, pickle.dumps(metadata), 1), shuffle), "ckpt/.index")
    keys = back.metadata.state_dict_metadata
    local = {fqn: _grid(shape, rng) for fqn, shape in shapes.items()}
    describe = lambda made: sorted(
        (i.dest_index.fqn, i.dest_index.index, tuple(i.storage_index.offset), i.storage_index.index, tuple(i.dest_offsets), tuple(i.storage_offsets), tuple(i.lengths))
        for i in made
    )
    stock = describe(item for fqn, chunks in local.items() for item in create_read_items_for_chunk_list(fqn, keys[fqn], chunks))
    shards = [(fqn, i, c) for fqn, chunks in local.items() for i, c in enumerate(chunks)]
    for batch_rows in (1, 5, load_plan.BATCH_ROWS):
        monkeypatch.setattr(load_plan, "BATCH_ROWS", batch_rows)
        reads = tensor_reads(keys, shards)
        made = reads.read_items()
        assert describe(made) == stock
        # each piece's index row is its saved chunk's record, found without a lookup
        fqns = [reads.fqn(piece) for piece in range(len(reads))]
        loc = back.items.locations(np.array(reads.rows, np.int64))
        found = zip(fqns, loc.file.tolist(), loc.offset.tolist(), loc.length.tolist(), loc.payload.tolist(),
                    loc.transformed.tolist(), loc.has_checksum.tolist())
        assert [(back.items.file_name(code, fqn), *where) for fqn, code, *where in found] == [
            (item.relative_path, item.offset, item.length, item.payload_offset, bool(item.transforms), item.checksum is not None)
            for item in (back.items[read.storage_index] for read in made)
        ]


def test_stacked_boxes_refuse_keys_of_several_ndims():
    """A row's offsets are read as its batch's ndim of values: keys of another ndim would be misread."""
    keys = decode_index(encoded()[0], "ckpt/.index").metadata.state_dict_metadata
    ks, _, _ = keys.key_facts(["w", "norm"])
    with pytest.raises(ValueError, match="one ndim"):
        keys.stacked_boxes(ks)
    bounds, off, size, rows = keys.stacked_boxes(ks[:1])
    assert bounds.tolist() == [0, 2] and off.tolist() == [[0, 0], [3, 0]] and size.tolist() == [[3, 3], [2, 3]]
    assert len(rows) == 2


def test_an_index_written_with_its_arrow_schema_decodes_alike():
    """Indexes written before stop 51 stored the Arrow schema (holding the header a second
    time) and zstd columns; they decode to the same objects as one written now."""
    metadata, items, copies = checkpoint()
    data = encode_index(metadata, items, b"m", 1, copies)
    file = pq.ParquetFile(io.BytesIO(data), read_dictionary=index_module._DICTIONARY_COLUMNS)
    table = file.read().cast(index_module._SCHEMA.with_metadata(file.metadata.metadata))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")  # as encode_index wrote it until then
    older = sink.getvalue()
    assert b"ARROW:schema" in pq.ParquetFile(io.BytesIO(older)).metadata.metadata
    new, old = decode_index(data, "ckpt/.index"), decode_index(older, "ckpt/.index")
    assert dict(old.items) == dict(new.items) == items
    assert {k: v for k, v in old.copies.items()} == {k: v for k, v in new.copies.items()}
    assert dict(old.metadata.state_dict_metadata) == dict(new.metadata.state_dict_metadata)
    assert (old.metadata.planner_data, old.metadata_crc32c, old.metadata_size) == (new.metadata.planner_data, 1, 1)


def test_the_written_columns_are_what_pyarrow_reads_row_by_row():
    """The columns are built from buffers (``formats.arrow_columns``), not by pyarrow's
    conversions: a valid table of the index schema, nulls where a row has no box, dtype,
    checksum or transform."""
    metadata, items, copies = checkpoint()
    without = MetadataIndex("w", [3, 0])
    items[without] = items[without]._replace(checksum=None)
    file = pq.ParquetFile(io.BytesIO(encode_index(metadata, items, b"m", 1, copies)), read_dictionary=index_module._DICTIONARY_COLUMNS)
    assert list(file.metadata.metadata) == [b"dcp_ext"]  # the header once: no Arrow schema (holding it again) beside it
    table = file.read()
    table.validate(full=True)
    assert table.schema.names == index_module._SCHEMA.names
    table = table.cast(index_module._SCHEMA)  # the dtype column's dictionary comes back with int32 indices, not int8
    names = ["fqn", "offsets", "sizes", "dtype", "file", "offset", "length", "payload_offset", "checksum", "copy", "transforms"]
    rows = [
        ["w", [0, 0], [3, 3], "bfloat16", "__0_0.distcp", 0, 900, 800, 11, False, None],
        ["w", [3, 0], [2, 3], "bfloat16", "__1_0.distcp", 0, 700, 600, None, False, None],
        ["norm", [0], [7], "float32", "__0_0.distcp", 900, 600, 1000, 13, False, "zstd"],
        ["empty", [0, 0], [0, 4], "int64", "__0_0.distcp", 1500, 500, -1, 14, False, None],
        ["step", None, None, None, "__1_0.distcp", 700, 40, -1, 15, False, None],
        ["norm", [0], [7], "float32", "__1_0.distcp", 740, 600, 840, 13, True, "zstd"],
    ]
    assert table.to_pylist() == [dict(zip(names, row)) for row in rows]
    back = decode_index(encode_index(metadata, items, b"m", 1, copies), "ckpt/.index")
    assert dict(back.items) == items
