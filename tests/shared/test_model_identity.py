"""The model fingerprint: config and weight headers and samples, never whole tensors."""

import json
import shutil
import struct

import pytest

from shared import model_identity
from shared.model_identity import SAMPLE_BYTES, fingerprint

TENSOR_BYTES = 1024


def write_safetensors(path, tensors, data=b"", meta=None):
    """A safetensors file: 8-byte length, JSON header, then `data`."""
    header = {name: {"dtype": "BF16", "shape": [TENSOR_BYTES // 2], "data_offsets": [i * TENSOR_BYTES,
                                                                                     (i + 1) * TENSOR_BYTES]}
              for i, name in enumerate(tensors)}
    if meta:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + (data or bytes(len(tensors) * TENSOR_BYTES)))


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 32}')
    (folder / "tokenizer.json").write_text("{}")
    write_safetensors(folder / "model-00001.safetensors", ["a.weight", "b.weight"])
    write_safetensors(folder / "model-00002.safetensors", ["c.weight"])
    return folder


def test_fingerprint_is_stable_and_independent_of_where_the_folder_is(model, tmp_path):
    first = fingerprint(model)
    assert len(first) == 64 and int(first, 16) >= 0
    assert fingerprint(model) == first
    assert fingerprint(shutil.copytree(model, tmp_path / "elsewhere")) == first


def test_a_changed_config_changes_it(model):
    before = fingerprint(model)
    (model / "config.json").write_text('{"hidden_size": 64}')
    assert fingerprint(model) != before


def test_a_changed_safetensors_header_changes_it(model):
    before = fingerprint(model)
    write_safetensors(model / "model-00002.safetensors", ["c.weight"], meta={"format": "pt"})
    assert fingerprint(model) != before


def test_new_weights_with_the_same_header_change_it(model):
    # A fine-tune of the same architecture: byte-identical header, other values.
    before = fingerprint(model)
    data = bytearray(2 * TENSOR_BYTES)
    data[TENSOR_BYTES + TENSOR_BYTES // 2] = 1  # in the middle of b.weight
    write_safetensors(model / "model-00001.safetensors", ["a.weight", "b.weight"], bytes(data))
    assert fingerprint(model) != before


def test_a_renamed_or_added_weight_file_changes_it(model):
    before = fingerprint(model)
    (model / "model-00002.safetensors").rename(model / "model-00003.safetensors")
    renamed = fingerprint(model)
    (model / "pytorch_model.bin").write_bytes(b"\x80" * 10_000)
    assert len({before, renamed, fingerprint(model)}) == 3


def test_the_tokenizer_does_not_change_it(model):
    # KV depends on token ids and weights only: a tokenizer fix keeps the cache valid.
    before = fingerprint(model)
    (model / "tokenizer.json").write_text('{"changed": true}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert fingerprint(model) == before


def test_tensor_data_is_sampled_not_read(model, monkeypatch):
    # A big checkpoint (sparse: 8 GiB that take no disk) whose header names 3 tensors.
    big = model / "model-00002.safetensors"
    write_safetensors(big, ["c.weight", "d.weight", "e.weight"])
    with big.open("r+b") as f:
        f.truncate(8 << 30)
    reads = []
    real = model_identity._read_at
    monkeypatch.setattr(model_identity, "_read_at", lambda f, offset, n: reads.append(n) or real(f, offset, n))
    fingerprint(model)
    assert len(reads) == 2 + 3 and sum(reads) <= 5 * SAMPLE_BYTES


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        fingerprint(tmp_path)


@pytest.mark.parametrize("content", [b"\x01\x02", struct.pack("<Q", 1 << 40), struct.pack("<Q", 3) + b"{x}"])
def test_a_broken_safetensors_file_is_refused(model, content):
    (model / "model-00002.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="model-00002"):
        fingerprint(model)
