"""`yuebing secrets`: a cluster's secrets for compose or a deployment (yuebing/secrets.py).

`yuebing up` makes its own for every run; this is for clusters it does not start:
one owner-only file per identity, nats-server's configuration, the messengers' KV
key, an API key for the gateway and, with --nats-tls, a CA and the server's
certificate. Hand each process only its own file (compose/docker-compose.yml's
`secrets:` do). Rotating is running this again into a new folder and restarting.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from yuebing.secrets import Layout, Listen, generate, write_api_key

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("secrets", help="generate a cluster's credentials, keys and nats-server config")
    p.add_argument("--out", required=True, help="a new folder (made owner-only); existing files are never overwritten")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (prefill-0 ...)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (decode-0 ...)")
    p.add_argument("--nodes", type=int, default=1, help="nodes, one messenger each (messenger-0 on node-0 ...)")
    p.add_argument("--nats-host", default="127.0.0.1", help="address nats-server listens on")
    p.add_argument("--nats-port", type=int, default=4222, help="port nats-server listens on")
    p.add_argument("--nats-tls", action="store_true", help="TLS, with a CA made for this cluster")
    p.add_argument("--tls-name", action="append", default=[], help="a name clients reach nats-server by "
                   "(repeatable; default: localhost and 127.0.0.1)")
    p.add_argument("--mounted-at", help="where the files will be seen, if not at --out (compose: /run/secrets)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    layout = Layout(args.prefill, args.decode, args.nodes)
    names = tuple(args.tls_name) or Listen.tls_names
    mounted_at = Path(args.mounted_at) if args.mounted_at else None
    made = generate(Path(args.out), layout, Listen(args.nats_host, args.nats_port, args.nats_tls, names), mounted_at)
    api_key = write_api_key(made.folder)
    print(f"wrote {len(layout.identities())} NATS identities, {made.nats_config.name}, {made.kv_key.name} "
          f"and {api_key.name} to {made.folder}")
    return 0
