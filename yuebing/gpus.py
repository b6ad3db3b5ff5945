"""GPUs for the engines `yuebing up` starts: which GPUs the machine has (nvidia-smi)
and which each engine gets (its CUDA_VISIBLE_DEVICES). An engine takes its role's
tensor-parallel size times its pipeline stages, in order, never sharing a GPU with
another engine; asking for more than there are is refused before anything starts."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

AUTO, NONE = "auto", "none"


def listed_gpus() -> list[str]:
    """The GPU indices nvidia-smi lists; none where it is missing or fails."""
    return query("index")


def query(field: str) -> list[str]:
    """One `nvidia-smi --query-gpu` field, a GPU a line; none where it is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def usable(spec: str, listed: Sequence[str]) -> list[str]:
    """The GPUs `--gpus` lets engines use: `auto` (every one listed; none on a machine
    without: CPU engines), `none` (CPU engines), or indices such as `0,2,3`, each listed."""
    if spec == AUTO:
        return list(listed)
    if spec == NONE:
        return []
    wanted = [part.strip() for part in spec.split(",") if part.strip()]
    if not wanted or not all(part.isdigit() for part in wanted) or len(set(wanted)) != len(wanted):
        raise ValueError(f"--gpus must be auto, none or distinct GPU indices such as 0,1; got {spec!r}")
    missing = [g for g in wanted if g not in listed]
    if missing:
        have = ", ".join(listed) if listed else "none (no nvidia-smi, or it lists no GPU)"
        raise ValueError(f"--gpus names GPU {', '.join(missing)}, which nvidia-smi does not list; it lists: {have}")
    return wanted


def assign(needs: Sequence[tuple[str, int]], gpus: Sequence[str]) -> dict[str, str]:
    """Each engine's CUDA_VISIBLE_DEVICES, from (engine name, GPUs it needs) in start
    order; {} with no GPUs (CPU engines). Refuses needs beyond the GPUs there are."""
    if not gpus:
        return {}
    total = sum(n for _, n in needs)
    if total > len(gpus):
        asked = ", ".join(f"{name} {n}" for name, n in needs)
        raise ValueError(f"the engines need {total} GPUs ({asked}), but {len(gpus)} are available "
                         f"({', '.join(gpus)}): start fewer instances, lower the tensor-parallel sizes, "
                         "or name more GPUs with --gpus")
    plan, at = {}, 0
    for name, n in needs:
        plan[name] = ",".join(gpus[at : at + n])
        at += n
    return plan
