"""The default model writer: deterministic files, a complete LLaMA checkpoint, and a
tokenizer whose vocabulary covers every id the model can emit."""

import json

import pytest
from safetensors import safe_open

from yuebing.model import ModelSpec, write_model

SMALL = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, max_position=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "model"
    write_model(SMALL, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_spec_gives_byte_identical_files(model_dir, tmp_path):
    write_model(SMALL, tmp_path / "again")
    assert _files(tmp_path / "again") == _files(model_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(_files(model_dir))  # fmt: skip


def test_another_seed_gives_other_weights(model_dir, tmp_path):
    write_model(ModelSpec(**{**SMALL.__dict__, "seed": 1}), tmp_path / "other")
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_checkpoint_has_every_llama_weight_with_its_shape(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 512
    v, h, i, hd = config["vocab_size"], 64, 96, 16
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(2):
        p = f"model.layers.{n}."
        expected |= {
            p + "self_attn.q_proj.weight": (4 * hd, h),
            p + "self_attn.k_proj.weight": (2 * hd, h),
            p + "self_attn.v_proj.weight": (2 * hd, h),
            p + "self_attn.o_proj.weight": (h, 4 * hd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected


def test_every_token_id_decodes_and_the_vocab_matches_the_config(model_dir, tokenizer):
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(vocab_size))
    text = "héllo, 月饼 <|eot_id|>"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("a")[0] == tokenizer.bos_token_id


def test_chat_template_renders_and_tokenizes_a_conversation(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "fields",
    [{"layers": 0}, {"hidden": -8}, {"hidden": 250}, {"kv_heads": 3}, {"dtype": "int8"}, {"max_position": 0}],
)
def test_invalid_specs_are_refused(fields):
    with pytest.raises(ValueError):
        ModelSpec(**fields)


def test_refuses_a_non_empty_folder_unless_told_to_overwrite(model_dir, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        write_model(SMALL, out)
    write_model(SMALL, out, overwrite=True)
    assert _files(out) == _files(model_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left behind
