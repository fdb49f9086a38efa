"""The loader's own safetensors reader (one pread per tensor, off the GIL) against the safetensors package."""
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models.errors import ModelLoadError
from jaxserve.models import tensor_file
from jaxserve.models.tensor_file import map_safetensors, read_tensor, safetensors_header, write_safetensors


def test_every_tensor_reads_back_as_the_package_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_file, "READ_CHUNK", 100)   # tensors of several chunks, the last one partial
    rng = np.random.default_rng()
    tensors = {"a.bf16": rng.standard_normal((67, 33)).astype(ml_dtypes.bfloat16),
               "b.f16": rng.standard_normal((5,)).astype(np.float16),
               "c.f32": rng.standard_normal((3, 4, 5)).astype(np.float32),
               "d.f64": rng.standard_normal((2, 9)).astype(np.float64)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    expected = load_file(tmp_path / "m.safetensors")
    header = safetensors_header(tmp_path / "m.safetensors")
    assert sorted(t.name for t in header) == sorted(tensors)
    offsets = [t.offset for t in header]
    assert offsets == sorted(offsets)   # file order: the reads stay sequential
    with open(tmp_path / "m.safetensors", "rb", buffering=0) as f, ThreadPoolExecutor(3) as pool:
        for t in header:
            read = read_tensor(f, t, pool)
            assert read.dtype == expected[t.name].dtype and read.shape == expected[t.name].shape
            np.testing.assert_array_equal(read.view(np.uint8), expected[t.name].view(np.uint8))


@pytest.mark.parametrize("spoil, reason", [
    (lambda raw: raw[:-7], "do not hold"),                       # cut short
    (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "header length"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "header"),           # broken JSON
])
def test_a_corrupt_file_is_refused_naming_it(tmp_path, spoil, reason):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, path)
    path.write_bytes(spoil(path.read_bytes()))
    with pytest.raises(ModelLoadError, match=reason) as e:
        safetensors_header(path)
    assert "m.safetensors" in str(e.value)


def test_written_files_read_back_here_and_in_the_package(tmp_path):
    """write_safetensors' files (what `prepared` keeps): the safetensors package reads their numpy dtypes as
    written; mapped here, every tensor (bf16 and e4m3 included) has its dtype, shape and bytes back."""
    rng = np.random.default_rng()
    tensors = {"w.bf16": rng.standard_normal((7, 3)).astype(ml_dtypes.bfloat16),
               "w.e4m3": rng.standard_normal((5, 2)).astype(ml_dtypes.float8_e4m3fn),
               "x.f32": rng.standard_normal((3, 4, 5)).astype(np.float32),
               "s": np.array(2.5, np.float32), "ids": np.arange(5, dtype=np.int32)}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    mapped = map_safetensors(tmp_path / "t.safetensors")
    assert mapped.keys() == tensors.keys()
    for name, a in tensors.items():
        assert mapped[name].dtype == a.dtype and mapped[name].shape == a.shape, name
        assert mapped[name].tobytes() == a.tobytes(), name
    numpy_ones = {k: v for k, v in tensors.items() if v.dtype in (np.float32, np.int32)}
    write_safetensors(tmp_path / "n.safetensors", numpy_ones)
    for name, a in load_file(tmp_path / "n.safetensors").items():
        np.testing.assert_array_equal(a, numpy_ones[name])
