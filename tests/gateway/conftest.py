"""The gateway's tests: the model's tokenizer, for those that turn text into tokens
and back."""

import pytest

from services.gateway.text import Tokenizer
from yuebing.model import ModelSpec, default_model_dir, write_model


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = default_model_dir()
    if not (path / "config.json").exists():  # a tiny model is enough: only its tokenizer is used
        path = tmp_path_factory.mktemp("m") / "tiny"
        write_model(ModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64), path)
    return Tokenizer(str(path))
