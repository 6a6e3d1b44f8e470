"""GGUF reading: metadata of the real models, speed, and a clear error for every way a file
can be wrong (never a traceback)."""

import struct
import time

import numpy as np
import pytest

from brass.errors import BrassError, GGUFError, UnsupportedError
from brass.gguf import GGMLType, GGUFFile


def _write_tiny(path, arch="llama", tensor_type=None):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_uint32("test.value", 7)
    w.add_array("test.array", [1, 2, 3])
    w.add_array("test.strings", ["a", "bé", "💥"])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((4, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    return _write_tiny(tmp_path / "tiny.gguf")


def test_reads_what_gguf_py_wrote(tiny):
    g = GGUFFile(tiny)
    assert g.architecture == "llama"
    assert g.metadata["test.value"] == 7
    assert list(g.metadata["test.array"]) == [1, 2, 3]
    assert g.metadata["test.strings"] == ["a", "bé", "💥"]
    t = g.tensors["a.weight"]
    assert t.shape == (32, 2) and t.type == GGMLType.F32
    a = g.tensor_bytes("a.weight").view(np.float32).reshape(2, 32)
    assert np.array_equal(a, np.arange(64, dtype=np.float32).reshape(2, 32))
    assert g.tensors["b.weight"].type == GGMLType.F16


@pytest.mark.parametrize("alignment", [64, 256, 8])
def test_reads_files_with_another_alignment(tmp_path, alignment):
    """general.alignment other than the default 32: tensor data starts on that boundary, and
    each tensor's offset is padded to it; reading at the default would misplace every tensor."""
    import gguf
    rng = np.random.default_rng(alignment)
    tensors = {f"t{i}.weight": rng.standard_normal((3, 5 + i)).astype(np.float32) for i in range(4)}
    path = tmp_path / "aligned.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_string("test.pad", "x" * 7)          # an odd-sized header, so the padding matters
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)
    assert g.alignment == alignment and g.data_offset % alignment == 0
    for name, a in tensors.items():
        assert np.array_equal(g.tensor_bytes(name).view(np.float32).reshape(a.shape), a), name


def test_matches_gguf_py_on_real_model(real_model_path):
    """Every metadata value and tensor directory entry equals gguf-py's reading."""
    import gguf
    path = real_model_path("smollm2-135m")
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    for name, field in ref.fields.items():
        if name.startswith("GGUF."):
            continue
        v = field.contents()
        mine = ours.metadata[name]
        if isinstance(v, list):
            assert list(mine) == v, name
        else:
            assert mine == pytest.approx(v) if isinstance(v, float) else mine == v, name
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(x) for x in t.shape), t.name
        assert mine.type == int(t.tensor_type), t.name
        assert mine.offset == int(t.data_offset), t.name
        assert mine.nbytes == int(t.n_bytes), t.name


def test_open_is_fast(real_model_path):
    """Opening the 151,936-token Qwen file and reading metadata + tokenizer takes < 1 s
    (gguf-py's reader takes 6-9 s)."""
    path = real_model_path("qwen2.5-coder-0.5b")
    from brass.tokenizer import Tokenizer
    times = []
    for _ in range(3):      # best of three: a busy machine (CI neighbours, xdist) adds noise
        t0 = time.perf_counter()
        Tokenizer.from_gguf(GGUFFile(path))
        times.append(time.perf_counter() - t0)
    assert min(times) < 1.0, f"open + tokenizer took {min(times):.2f} s (best of {times})"


def test_wrong_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_too_short(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [30, 200, 400])
def test_truncated_header(tiny, keep):
    data = tiny.read_bytes()
    tiny.write_bytes(data[:keep])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(tiny)


def test_tensor_data_out_of_range(tiny):
    data = tiny.read_bytes()
    tiny.write_bytes(data[:-16])          # drop the end of the last tensor's data
    with pytest.raises(GGUFError, match="beyond the end of the file"):
        GGUFFile(tiny)


def test_unsupported_version(tiny):
    data = bytearray(tiny.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    tiny.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="version 99"):
        GGUFFile(tiny)


def test_unknown_tensor_type(tiny):
    g = GGUFFile(tiny)
    data = bytearray(tiny.read_bytes())
    # the type field of "b.weight" follows its name, dim count and dims in the directory
    name = b"b.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == GGMLType.F16
    struct.pack_into("<I", data, at, 77)
    tiny.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="unknown type id 77"):
        GGUFFile(tiny)
    del g


def test_unknown_architecture(tmp_path):
    from brass.model import Model
    p = _write_tiny(tmp_path / "m.gguf", arch="notanarch")
    with pytest.raises(UnsupportedError, match="architecture 'notanarch' is not supported"):
        Model(p, backend="numpy", quiet=True)


def test_errors_are_user_errors():
    assert issubclass(GGUFError, BrassError) and issubclass(UnsupportedError, BrassError)
