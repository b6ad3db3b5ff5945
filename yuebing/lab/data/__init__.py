"""Data the lab ships with, so that the simulator and its tests need nothing beside
the repository (README.md here says where each file comes from and under which
licence).

- `GPU_PROFILE`: timing rows measured on an H100 for LLaMA-8B and LLaMA2-70B, the
  simulator's default time model (`yuebing sim --profile`).
- `CONVERSATION_TRACE`: Mooncake's published conversation trace, gzipped
  (`yuebing.lab.trace.load_trace` reads it as it is).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

GPU_PROFILE = _HERE / "h100-dense-llama.json"
CONVERSATION_TRACE = _HERE / "conversation_trace.jsonl.gz"
