"""Model shapes that size simulated and benchmarked work: the connector bench's
synthetic model, the simulator's KV transfers and its tensor-parallel instances."""

from __future__ import annotations

from dataclasses import dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    block_size: int = 16  # tokens per KV block of the connector bench's caches (vLLM's block size)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bf16."""
        return self.layers * self.kv_heads * self.head_dim * 2 * BF16_BYTES

    @property
    def weight_bytes(self) -> int:
        """bf16 weights: attention, SwiGLU MLP, and untied embedding and LM head (norms left out)."""
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return (self.layers * (attention + mlp) + 2 * self.vocab * self.hidden) * BF16_BYTES


SHAPES = {
    "tiny": ModelShape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=259),
    "llama3-8b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                            vocab=128256, block_size=128),
    "llama2-70b": ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                             vocab=32000, block_size=128),
}
