"""`yuebing bench transfer`: messenger → messenger throughput over ZeroMQ and over
Mooncake's Transfer Engine, against the bare engine and memcpy, per block size
(yuebing/bench/transfer.py)."""

from __future__ import annotations

import argparse

from yuebing.commands import add_json_flag, write_json

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="messenger→messenger throughput vs bare Mooncake TE and memcpy")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384], help="block sizes, KiB")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per block size, MiB")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench import transfer

    print(f"messenger → messenger over ZeroMQ and Mooncake TE (TCP loopback), {args.total_mib} MiB per block size:")
    results = transfer.run([k * 1024 for k in args.sizes_kib], args.total_mib << 20)
    print(transfer.table(results))
    write_json(transfer.to_json(results), args.json)
    return 0
