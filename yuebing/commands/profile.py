"""`yuebing profile`: measure the engine and fit the Conductor's time models
(yuebing/profile.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.config import DEFAULT_PROFILE
from yuebing.model import default_model_dir

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure the engine and fit the Conductor's time models")
    p.add_argument("--model", default=str(default_model_dir()), help="the model folder")
    p.add_argument("--out", default=str(DEFAULT_PROFILE), help="the profile to write")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (their minimum counts)")
    p.add_argument("--quick", action="store_true",
                   help="a short grid, one timed run a point (what `yuebing up` runs for a model with no profile)")
    p.add_argument("--max-model-len", type=int, default=4096, help="the engine's context limit, tokens")
    p.add_argument("--dtype", default="float32",
                   help="the engine's dtype: the cluster's own (`yuebing up --dtype`) for a profile it loads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.profile import QUICK, Grid, profile

    grid = QUICK if args.quick else Grid(repeats=args.repeats)
    meta = profile(Path(args.model), Path(args.out), grid, args.max_model_len, args.dtype)
    errors = meta["held_out_mape_percent"]
    print(f"wrote {args.out} in {meta['seconds']:.0f}s")
    print(f"held-out error (MAPE): prefill {errors['prefill']:.1f} %, decode step {errors['decode']:.1f} %")
    print(f"KV bytes per token {meta['kv_bytes_per_token']}, transport {meta['transfer_GBps']:.2f} GB/s")
    return 0
