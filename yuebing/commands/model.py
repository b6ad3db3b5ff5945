"""`yuebing model init`: write the default dummy model (yuebing/model.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

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


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.if_missing and (out / "config.json").exists():
        print(f"model already at {out}")
        return 0
    write_model(from_args(ModelSpec, args, ALIASES), out, overwrite=args.force)
    print(f"wrote {out}")
    return 0
