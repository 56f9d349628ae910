"""The compat store's tensor object layout (Mooncake's 304-byte ``TensorMetadata``: a 40-byte
header + 264 bytes of layout, then the data) and the safetensors files of
``save_tensor_to_safetensor`` / ``load_tensor_from_safetensor``. Pure: no store needed."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pymooncake.store.compat import _safetensors, _tensor
from pymooncake.store.compat._tensor_tp import _shards, tp_key


def test_layout_is_mooncakes() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = _tensor.tensor_bytes(arr)
    # Mooncake's scripts size buffers as 304 + numel * element_size
    assert _tensor.METADATA_SIZE == 304 and len(data) == 304 + arr.nbytes
    magic, ver, hsize, dtype, ndim, kind, flags, off, nbytes = struct.unpack_from(
        "<IHHiiIIQQ", data)
    assert (magic, ver, hsize) == (0x4D4F4F4E, 1, 304)
    assert (dtype, ndim, kind, flags, off, nbytes) == (0, 2, 0, 0, 304, 48)  # FLOAT32 = 0
    global_shape = struct.unpack_from("<8q", data, 40)
    local_shape = struct.unpack_from("<8q", data, 104)
    assert global_shape == local_shape == (3, 4, -1, -1, -1, -1, -1, -1)
    assert struct.unpack_from("<II", data, 168) == (0, 0)  # no layout axes
    assert data[304:] == arr.tobytes()


@pytest.mark.parametrize("dtype,code", [("float64", 1), ("int8", 2), ("uint8", 3),
                                        ("int16", 4), ("int32", 6), ("int64", 8),
                                        ("bool", 10), ("float16", 11)])
def test_dtype_codes_round_trip(dtype: str, code: int) -> None:
    arr = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    data = _tensor.tensor_bytes(arr)
    assert struct.unpack_from("<i", data, 8)[0] == code
    m = _tensor.parse(data, len(data))
    assert m is not None and m.local_shape == (2, 3) and m.data_bytes == arr.nbytes


def test_invalid_objects_are_not_tensors() -> None:
    data = _tensor.tensor_bytes(np.zeros(4, dtype=np.int32))
    assert _tensor.parse(data[:-1], len(data) - 1) is None  # data_bytes != what is there
    assert _tensor.parse(b"x" * 400, 400) is None  # no magic
    assert _tensor.parse(data[:100], 100) is None  # shorter than the metadata
    bad = bytearray(data)
    bad[8:12] = struct.pack("<i", 99)  # unknown dtype
    assert _tensor.parse(bytes(bad), len(bad)) is None
    with pytest.raises(TypeError):
        _tensor.tensor_bytes([1, 2, 3])


def test_torch_bf16_round_trip() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    data = _tensor.tensor_bytes(t)
    assert struct.unpack_from("<i", data, 8)[0] == 12  # BFLOAT16 = 12
    got = _tensor.tensor_from(data)
    assert got.dtype == torch.bfloat16 and torch.equal(got, t)


def test_tp_shards_as_mooncake() -> None:
    arr = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    code, shape, raw = _tensor.raw_of(arr)
    shards = _shards(code, shape, raw, 2, 0)
    got = [np.asarray(_tensor.tensor_from(s)) for s in shards]
    assert [g.shape for g in got] == [(2, 6), (2, 6)]
    assert np.array_equal(np.concatenate(got), arr)
    m = _tensor.parse(shards[1], len(shards[1]))
    assert m.kind == _tensor.SHARD and m.global_shape == (4, 6)
    assert m.axes == ((_tensor.AXIS_TP, 1, 2, 0),)
    # the axis record as Mooncake 0.3.13 writes it: kind, index, rank, count, split dim,
    # 0, this piece's extent along the split dim; unused axis records all zero
    cols = _shards(code, shape, raw, 3, 1)
    assert struct.unpack_from("<iiiiiiq", cols[2], 176) == (1, 0, 2, 3, 1, 0, 2)
    assert cols[2][208:304] == bytes(96)
    assert np.array_equal(np.concatenate([np.asarray(_tensor.tensor_from(s)) for s in cols],
                                         axis=1), arr)
    assert _shards(code, shape, raw, 4, 1) is None  # 6 columns do not split 4 ways: -600
    assert _shards(code, shape, raw, 2, 2) is None  # no such dim
    assert _shards(code, shape, raw, 2, -1) is None  # Mooncake refuses a negative dim too
    assert tp_key("w", 3) == "w_tp_3"


def test_safetensors_file_round_trip(tmp_path) -> None:
    arr = np.arange(6, dtype=np.float16).reshape(2, 3)
    data = _tensor.tensor_bytes(arr)
    meta = _tensor.parse(data, len(data))
    path = tmp_path / "t.safetensors"
    _safetensors.save(str(path), "weight", meta, memoryview(data)[304:])
    entries = _safetensors.load(str(path))
    assert list(entries) == ["weight"]
    code, shape, raw = entries["weight"]
    assert (code, shape, raw) == (11, (2, 3), arr.tobytes())
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len % 8 == 0  # the format's 8-byte alignment of the data
    st = pytest.importorskip("safetensors.numpy")
    assert np.array_equal(st.load_file(str(path))["weight"], arr)  # readable by the library
    other = tmp_path / "o.safetensors"
    st.save_file({"a": np.ones((2, 2), np.int64), "b": np.zeros(3, np.float32)}, str(other))
    got = _safetensors.load(str(other))
    assert got["a"][:2] == (8, (2, 2)) and got["b"][:2] == (0, (3,))


def test_safetensors_bad_files(tmp_path) -> None:
    p = tmp_path / "bad"
    p.write_bytes(b"\x01")
    with pytest.raises(ValueError):
        _safetensors.load(str(p))
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError):
        _safetensors.load(str(p))
    p.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert _safetensors.load(str(p)) == {}
