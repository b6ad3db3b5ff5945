"""A fingerprint of a model folder's weights, for the model's identity.

The served name alone does not say which weights computed a cached KV block: new
weights under the same name would reuse the old blocks from the pool's SSD tier. The
fingerprint is folded into the block-hash salt and the pool headers beside the name.

What goes in, and why:
- config.json, whole: architecture, RoPE scaling, quantization all change the KV.
- every *.safetensors file, in name order: its name, its header (the 8-byte length and
  the JSON of tensor names, dtypes, shapes and offsets), and a small sample of each
  tensor's bytes (SAMPLE_BYTES from its middle). The header alone is not enough: a
  fine-tune of the same architecture has a byte-identical header. A fine-tune changes
  every element of the tensors it touches, so one sample per tensor catches it while
  reading a few hundred KB for a 70B checkpoint (one small read per tensor).
- other weight files vLLM loads (*.bin, *.pt, *.pth), whose format we do not parse:
  name, size and FILE_SAMPLES evenly spaced samples.
- not the tokenizer: KV is a function of token ids and weights only, and block hashes
  are taken over token ids, so a tokenizer or chat-template fix keeps the cache valid.

Not a content hash of every byte (that would read the whole checkpoint at every start);
weights edited in place at positions no sample covers would go unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

SAMPLE_BYTES = 64  # per tensor: 32 bf16 elements
FILE_SAMPLES = 16  # per weight file of a format we do not parse
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit; a larger length is a broken file


def fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """sha256 (hex) over the folder's config and weight headers and samples."""
    folder = Path(model_dir)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
    h = hashlib.sha256(b"yuebing-model-v1\0")
    _field(h, config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        _field(h, path.name.encode())
        with path.open("rb") as f:
            _safetensors(h, f, path)
    others = sorted(p for pattern in OTHER_WEIGHTS for p in folder.glob(pattern))
    for path in others:
        _field(h, path.name.encode())
        with path.open("rb") as f:
            _samples(h, f, path.stat().st_size)
    return h.hexdigest()


def _field(h: hashlib._Hash, data: bytes) -> None:
    # Length-prefixed, so that no two different sequences of fields hash alike.
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _safetensors(h: hashlib._Hash, f: BinaryIO, path: Path) -> None:
    """The header, then a sample from the middle of each tensor's bytes."""
    raw_len = f.read(8)
    if len(raw_len) != 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", raw_len)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: safetensors header of {length} bytes")
    header = f.read(length)
    _field(h, raw_len + header)
    try:
        tensors = json.loads(header)
    except ValueError as e:
        raise ValueError(f"{path}: unreadable safetensors header: {e}") from e
    data_start = 8 + length
    for name in sorted(k for k in tensors if k != "__metadata__"):
        begin, end = tensors[name]["data_offsets"]
        _field(h, _read_at(f, data_start + (begin + end) // 2, min(SAMPLE_BYTES, (end - begin + 1) // 2)))


def _samples(h: hashlib._Hash, f: BinaryIO, size: int) -> None:
    _field(h, str(size).encode())
    for i in range(FILE_SAMPLES):
        _field(h, _read_at(f, size * i // FILE_SAMPLES, 4096))


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)
