"""`yuebing compose up|down`: the compose cluster on this machine (yuebing/compose.py)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.compose import COMPOSE_DIR, ComposeOptions

    d = ComposeOptions()
    p = subparsers.add_parser("compose", help="build and start (or stop) the docker-compose cluster")
    p.add_argument("action", choices=["up", "down"], help="up: build, start and wait until serving; "
                   "down: remove the containers, networks and volumes")
    p.add_argument("--file", "-f", action="append", type=Path, default=[],
                   help=f"an override file read after {d.files[0].relative_to(COMPOSE_DIR.parent)} "
                        "(repeatable), such as compose/docker-compose.colocated.yml")
    p.add_argument("--project", default=d.project, help="compose project name")
    p.add_argument("--secrets", type=Path, default=d.secrets, help="secrets folder (made if missing)")
    p.add_argument("--config", type=Path, default=d.config, help="the cluster config every service reads")
    p.add_argument("--port", type=int, default=d.api_port, help="host port of the API (on 127.0.0.1)")
    p.add_argument("--extra", choices=["cpu", "gpu"], default=d.extra, help="the image's vLLM build")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout_s, help="seconds to wait for serving")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.compose import ComposeOptions, DockerUnavailable, down, up

    options = ComposeOptions(
        files=(*ComposeOptions.files, *args.file), project=args.project, secrets=args.secrets,
        config=args.config, api_port=args.port, extra=args.extra, ready_timeout_s=args.ready_timeout,
        show_build=sys.stdout.isatty(),
    )
    try:
        if args.action == "down":
            down(options)
            print(f"compose project {options.project} removed")
        else:
            up(options, log_dir=Path(tempfile.gettempdir()))
            print(f"try: curl {options.url}/v1/models -H \"Authorization: Bearer $(cat {options.api_key_file})\"")
    except (DockerUnavailable, RuntimeError) as e:
        print(f"yuebing compose {args.action}: {e}", file=sys.stderr)
        return 1
    return 0
