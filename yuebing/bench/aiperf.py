"""A third-party client for `yuebing bench goodput --client aiperf`: NVIDIA's AIPerf
replays each probe's trace with its fixed schedule (each request sent at its
timestamp), streaming chat requests that it writes and times itself, against one
server or round-robin over several. Yuebing only writes the trace in the Mooncake
format AIPerf reads and reads back its per-request records.

AIPerf is not a dependency of Yuebing (it pulls in a web stack of its own): `make
aiperf` installs it into `.venv-aiperf`, or `YUEBING_AIPERF` names an `aiperf`
executable. Its prompts come from a tokenizer it loads by Hugging Face name: the
model folder is offered to it as an entry of a private, offline Hugging Face cache
(AIPerf's worker processes load tokenizers offline, by name, from the cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from yuebing.lab.outcome import Outcome, gap_stats
from yuebing.lab.trace import TraceRequest

VERSION = "0.13.0"
TOKENIZER_REPO = "yuebing/tokenizer"  # the name AIPerf loads the model's tokenizer under
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "tokenizer.model", "generation_config.json")
# Tokens the chat template adds around a prompt (AIPerf sends chat requests): the
# trace's prompts are capped this much below the context, so that none is a 400.
CHAT_TEMPLATE_TOKENS = 64


@dataclass(frozen=True)
class Run:
    """One AIPerf replay: where its files go and what it sends."""

    urls: tuple[str, ...]
    model_name: str
    block_tokens: int  # tokens per hash id of the trace (AIPerf's --isl-block-size)
    work: Path  # the dataset, the tokenizer cache and AIPerf's artifacts go here
    seed: int = 0
    api_key: str | None = None
    request_timeout_s: float = 300.0


def executable() -> str:
    """The `aiperf` to run: $YUEBING_AIPERF, the repo's .venv-aiperf, or the PATH's."""
    named = os.environ.get("YUEBING_AIPERF")
    local = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"
    found = named or (str(local) if local.exists() else shutil.which("aiperf"))
    if not found or not Path(found).exists():
        raise RuntimeError(f"AIPerf not found: `make aiperf` installs aiperf=={VERSION} into .venv-aiperf "
                           "(or set YUEBING_AIPERF to an aiperf executable)")
    return found


def dataset_lines(trace: Sequence[TraceRequest]) -> list[str]:
    """The trace in the Mooncake format AIPerf's fixed schedule replays."""
    return [json.dumps({"timestamp": round(r.timestamp_ms), "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) for r in trace]


def tokenizer_cache(model: Path, root: Path) -> Path:
    """An offline Hugging Face cache (HF_HOME) at `root` whose `TOKENIZER_REPO` is the
    model folder's tokenizer files."""
    repo = root / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            shutil.copyfile(model / name, snapshot / name)
    return root


def argv(run: Run, exe: str, dataset: Path, artifacts: Path) -> list[str]:
    """`aiperf profile`: streaming chat, the trace's schedule, outputs of exactly the
    trace's lengths (ignore_eos), no terminal UI."""
    urls = [arg for url in run.urls for arg in ("--url", url)]
    key = ["--api-key", run.api_key] if run.api_key else []
    return [exe, "profile", "--model", run.model_name, "--tokenizer", TOKENIZER_REPO, *urls,
            "--endpoint-type", "chat", "--streaming", "--input-file", str(dataset),
            "--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--isl-block-size", str(run.block_tokens),
            "--extra-inputs", "ignore_eos:true", "--random-seed", str(run.seed), "--request-timeout-seconds",
            f"{run.request_timeout_s:g}", "--artifact-dir", str(artifacts), "--ui-type", "none", *key]


def outcomes(records: Iterable[dict], trace: Sequence[TraceRequest], slo_ttft_s: float,
             slo_tbt_s: float) -> list[Outcome]:
    """A request's outcome from its AIPerf record, in the trace's order (a request
    AIPerf has no record of failed). A 429 is a refusal, another error a failure;
    TBT statistics come from AIPerf's gaps between streamed chunks."""
    by_session = {r["metadata"]["session_num"]: r for r in records if "metadata" in r}
    out = []
    for i, req in enumerate(trace):
        o = Outcome(req.timestamp_ms / 1e3, req.input_length, req.output_length, slo_ttft_s, slo_tbt_s)
        record = by_session.get(i)
        if record is None or record.get("error"):
            code = (record or {}).get("error", {}).get("code")
            o.rejected, o.failed = code == 429, code != 429
        else:
            metrics = record["metrics"]
            o.ttft_s = metrics["time_to_first_token"]["value"] / 1e3
            gaps = [g / 1e3 for g in (metrics.get("inter_chunk_latency") or {}).get("value", [])]
            o.tbt_mean_s, o.tbt_p90_s, o.tbt_tail_s = gap_stats(gaps)
        out.append(o)
    return out


def replay(run: Run, trace: Sequence[TraceRequest], model: Path, name: str, slo_ttft_s: float,
           slo_tbt_s: float) -> list[Outcome]:
    """Replay `trace` with AIPerf (artifacts under run.work / name); outcomes in the trace's order."""
    exe = executable()
    folder = run.work / name
    folder.mkdir(parents=True, exist_ok=True)
    dataset = folder / "trace.jsonl"
    dataset.write_text("\n".join(dataset_lines(trace)) + "\n")
    env = {**os.environ, "HF_HOME": str(tokenizer_cache(model, run.work / "aiperf-hf")), "HF_HUB_OFFLINE": "1"}
    deadline = trace[-1].timestamp_ms / 1e3 + run.request_timeout_s + 120.0 if trace else 120.0
    with open(folder / "aiperf.log", "w") as log:
        done = subprocess.run(argv(run, exe, dataset, folder / "artifacts"), stdout=log, stderr=subprocess.STDOUT,
                              env=env, timeout=deadline, check=False)
    records = folder / "artifacts" / "profile_export.jsonl"
    if done.returncode != 0 or not records.exists():
        raise RuntimeError(f"aiperf exited {done.returncode} without its records (see {folder / 'aiperf.log'})")
    with open(records) as f:
        return outcomes((json.loads(line) for line in f if line.strip()), trace, slo_ttft_s, slo_tbt_s)
