"""`yuebing secrets`: a cluster's secrets for compose or a deployment (yuebing/secrets.py).

`yuebing up` makes its own for every run; this is for clusters it does not start:
one owner-only file per identity, nats-server's configuration, the messengers' KV
key, an API key for the gateway and, with --nats-tls, a CA and the server's
certificate. Hand each process only its own file (compose/docker-compose.yml's
`secrets:` do). Rotating is running this again into a new folder and restarting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.private_file import write_private
from yuebing.secrets import KUBERNETES_NATS, Layout, Listen, Peer, generate, kubernetes_secrets, write_api_key

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
    p.add_argument("--nats-cluster", help="a NATS cluster: its servers' host names, comma-separated (nats-0,nats-1,"
                   "nats-2), each on --nats-port with routes on 6222 (--kubernetes: the manifests' three)")
    p.add_argument("--tls-name", action="append", default=[], help="a name clients reach nats-server by "
                   "(repeatable; default: localhost and 127.0.0.1)")
    p.add_argument("--mounted-at", help="where the files will be seen, if not at --out (compose: /run/secrets)")
    p.add_argument("--engine-nodes", action="store_true", help="every engine a node of its own with its messenger "
                   "beside it (the Kubernetes manifests' layout; --nodes is then unused)")
    p.add_argument("--kubernetes", type=Path, help="also write the set as Kubernetes Secrets to this YAML file "
                   "(compose/kubernetes/ mounts them; implies --engine-nodes, and engine pods log in with their "
                   "ServiceAccount tokens through the NATS auth callout: --prefill and --decode are then unused)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    layout = Layout(args.prefill, args.decode, args.nodes, engine_nodes=args.engine_nodes or bool(args.kubernetes),
                    engines_by_token=bool(args.kubernetes))
    names = tuple(args.tls_name)
    mounted_at = Path(args.mounted_at) if args.mounted_at else None
    cluster = tuple(Peer(h.strip(), args.nats_port) for h in args.nats_cluster.split(",") if h.strip()) \
        if args.nats_cluster else KUBERNETES_NATS if args.kubernetes else ()
    if args.nats_cluster and len(cluster) < 3:
        raise SystemExit("--nats-cluster: three servers or more (JetStream's quorum outlives one only from three)")
    listen = Listen(args.nats_host, args.nats_port, args.nats_tls, names or tuple(p.host for p in cluster) or
                    Listen.tls_names, cluster)
    made = generate(Path(args.out), layout, listen, mounted_at)
    api_key = write_api_key(made.folder)
    print(f"wrote {len(layout.identities())} NATS identities, {made.nats_config.name}, {made.kv_key.name} "
          f"and {api_key.name} to {made.folder}")
    if args.kubernetes:
        write_kubernetes(args.kubernetes, kubernetes_secrets(made.folder, layout))
        print(f"wrote them as Kubernetes Secrets to {args.kubernetes}: kubectl apply -f {args.kubernetes}")
    return 0


def write_kubernetes(path: Path, documents: list[dict]) -> None:
    """One YAML stream, each document written as JSON (which YAML is a superset of)."""
    write_private(path, "".join(f"---\n{json.dumps(d, indent=2)}\n" for d in documents).encode())
