"""`yuebing bench transfer`: messenger → messenger throughput over ZeroMQ, plain TCP
and Mooncake's Transfer Engine, against the bare engine and memcpy, per block size
(yuebing/bench/transfer.py)."""

from __future__ import annotations

import argparse

from yuebing.commands import add_json_flag, positive_int, write_json

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="messenger→messenger throughput vs bare Mooncake TE and memcpy")
    p.add_argument("--sizes-kib", type=positive_int, nargs="+", default=[64, 256, 1024, 4096, 16384],
                   help="block sizes, KiB")
    p.add_argument("--total-mib", type=positive_int, default=256, help="bytes moved per block size, MiB")
    p.add_argument("--tries", type=positive_int, default=3,
                   help="turns each transport and the bare engine take per block size, interleaved; each keeps its best")
    p.add_argument("--runs", type=positive_int, default=1,
                   help="whole runs one after the other, each printed, then the verdict per block size")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench import transfer

    runs = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs}: messenger → messenger over ZeroMQ, TCP and Mooncake TE (TCP loopback), "
              f"{args.total_mib} MiB per block size, best of {args.tries} interleaved tries:")
        runs.append(transfer.run([k * 1024 for k in args.sizes_kib], args.total_mib << 20, args.tries))
        print(transfer.table(runs[-1]))
        print(transfer.cpu_table(runs[-1]))
    if args.runs > 1:
        print(transfer.verdict(runs))
    write_json(transfer.to_json(runs), args.json)
    return 0
