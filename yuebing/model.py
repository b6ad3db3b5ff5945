"""Writes the default dummy model: a small LLaMA-architecture model with seeded random
weights and a byte-level tokenizer, as a Hugging Face model folder that vLLM and
transformers load like any other.

Its text is gibberish but its compute path is the real one. The same spec always gives
byte-identical files, so every machine serves the same model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

DTYPES = ("float32", "bfloat16", "float16")

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT)
BOS_ID, EOS_ID, EOT_ID = 256, 257, 260  # the byte tokens take ids 0..255
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

RMS_NORM_EPS = 1e-5
ROPE_THETA = 500000.0

# Greedy outputs are compared token for token between engines that compute the same
# logits in different orders (whole prompt at once vs. incrementally), so the top two
# logits must rarely be within rounding noise of each other: a wide logit spread.
LOGIT_STD = 8.0
UNPRINTABLE_LOGIT_SCALE = 0.3
# Attention and MLP each add ~unit RMS to the residual stream, as much as the token's
# own embedding, and attention scores have std ~4 (sharp, not uniform): the next token
# then depends on the context, not just on the last token, so a wrong or missing KV
# cache changes the output instead of going unnoticed.
BRANCH_STD = 1.0
QK_STD = 2.0

# Llama-3 headers; with tools, Hermes' tool-call format (what vLLM's `hermes` parser
# reads): the tools in a system turn, calls as <tool_call> JSON, results in <tool_response>.
TOOLS_PREAMBLE = (
    "You may call one or more functions. Their signatures are within <tools></tools>:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_INSTRUCTIONS.replace("'", "\\'") + "<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\n<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n' + message['content'] + '\n</tool_response><|eot_id|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """The model's shape; each field is also a flag of `yuebing model init`."""

    layers: Annotated[int, Meta(description="decoder layers")] = 4
    hidden: Annotated[int, Meta(description="hidden size")] = 256
    heads: Annotated[int, Meta(description="attention heads")] = 4
    kv_heads: Annotated[int, Meta(description="key/value heads (grouped-query attention)")] = 2
    intermediate: Annotated[int, Meta(description="MLP intermediate size")] = 688
    max_position: Annotated[int, Meta(description="longest context, tokens")] = 4096
    seed: Annotated[int, Meta(description="seed of the random weights")] = 0
    dtype: Annotated[str, Meta(description="dtype of the weights")] = "float32"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def default_model_dir() -> Path:
    return Path(os.environ.get("YUEBING_MODEL_DIR", Path(__file__).resolve().parents[1] / "models" / "yuebing-tiny"))


def write_model(spec: ModelSpec, out: Path, *, overwrite: bool = False) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True, or --force, to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside `out` and renamed into place, so a half-written model is never loaded.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_json(tmp / "config.json", _config(spec))
        _write_json(tmp / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID]})
        _write_weights(spec, tmp / "model.safetensors")
        _write_tokenizer(tmp, spec)
        # mkdtemp (and safetensors) create owner-only modes; a model is for everyone to read.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _config(spec: ModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, EOT_ID],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": spec.max_position,
        "mlp_bias": False,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": RMS_NORM_EPS,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "dtype": spec.dtype,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _output_scale(dtype):  # -> torch.Tensor of shape (VOCAB_SIZE, 1)
    import torch

    scale = torch.full((VOCAB_SIZE, 1), UNPRINTABLE_LOGIT_SCALE, dtype=dtype)
    scale[32:127] = 1.0  # printable ASCII
    scale[10] = 1.0  # newline
    scale[256:] = 1.0  # special tokens
    return scale


def _write_weights(spec: ModelSpec, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * std).to(dtype)

    h, i, q, kv = spec.hidden, spec.intermediate, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    # Every projection's input is ~unit RMS (after RMSNorm, or as q/k/v/gate/up outputs),
    # so std c/sqrt(fan_in) makes its output ~c RMS.
    ones = torch.ones(h, dtype=dtype)
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h, 1.0)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q, h, QK_STD / math.sqrt(h))
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h, QK_STD / math.sqrt(h))
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h, 1 / math.sqrt(h))
        tensors[p + "self_attn.o_proj.weight"] = normal(h, q, BRANCH_STD / math.sqrt(q))
        tensors[p + "mlp.gate_proj.weight"] = normal(i, h, 1 / math.sqrt(h))
        tensors[p + "mlp.up_proj.weight"] = normal(i, h, 1 / math.sqrt(h))
        tensors[p + "mlp.down_proj.weight"] = normal(h, i, BRANCH_STD / math.sqrt(i))
        tensors[p + "input_layernorm.weight"] = ones.clone()
        tensors[p + "post_attention_layernorm.weight"] = ones.clone()
    tensors["model.norm.weight"] = ones.clone()
    # Bytes outside printable ASCII get small logits, so greedy text is readable (and
    # valid UTF-8); special tokens keep full-size logits, so generations can still end.
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, h, LOGIT_STD / math.sqrt(h)) * _output_scale(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable character table, the alphabet of the ByteLevel steps."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_tokenizer(folder: Path, spec: ModelSpec) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    # One token per byte (id = byte value) and no merges: any text encodes, any id decodes.
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # As LLaMA 3: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tok.get_vocab_size() == VOCAB_SIZE
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    # Written by hand rather than with save_pretrained: no version strings, and the
    # generic class name loads in transformers 4 and 5 alike.
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,  # a chat turn ends the reply
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": spec.max_position,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(folder / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOT})
