"""`yuebing up`: run the local cluster (yuebing/launcher.py) until Ctrl-C.

Its flags are generated: the cluster's layout from `launcher.UpOptions`, every
setting of the config file from `shared.config.ClusterConfig` (yuebing/flags.py).
The tables below hold only where the flag a user types differs from the field.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.conductor.modes import CONDITIONAL_RULES, MODES
from services.conductor.policy import ADMISSIONS, PREFILL_POLICIES
from shared.config import ClusterConfig
from yuebing.flags import Alias, add_flags, from_args
from yuebing.launcher import UpOptions, up
from yuebing.model import default_model_dir
from yuebing.preflight import refuse_unloadable_model

GROUP = None
MIB = 1 << 20

LAYOUT_ALIASES = {
    # A file, not the key itself: a command line shows in `ps`.
    "api_key_file": Alias(path=True, default=os.environ.get("YUEBING_API_KEY_FILE")),
    "start_timeout_s": Alias("start-timeout"),
}
CONFIG_ALIASES = {
    "model": Alias(path=True),
    "profile": Alias(path=True),
    "kv_dir": Alias(path=True),
    "ssd_dir": Alias(path=True),
    "policy": Alias(choices=tuple(PREFILL_POLICIES)),
    "admission": Alias(choices=ADMISSIONS),
    "mode": Alias(choices=MODES),
    "conditional_rule": Alias(choices=tuple(CONDITIONAL_RULES)),
    "eviction": Alias(choices=("lru", "lfu")),
    "pool_bytes": Alias("pool-mib", scale=MIB, help="each node's KV block pool, MiB"),
    "ssd_bytes": Alias("ssd-mib", scale=MIB, help="SSD tier size per node, MiB"),
    "request_timeout_s": Alias("request-timeout"),
    "decode_time_s": Alias("decode-time"),
    "kv_wait_s": Alias("kv-wait"),
    "kv_stream_layers": Alias("kv-streaming"),
    "engine_prefix_caching": Alias("engine-prefix-cache"),
}
# The launcher's own: each run gets a free port (--nats-port chooses one).
NOT_FLAGS = ("nats_url", "model_fingerprint")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run the local cluster (Ctrl-C stops it)")
    add_flags(p.add_argument_group("layout"), UpOptions, LAYOUT_ALIASES, skip=("config",))
    add_flags(p.add_argument_group("cluster settings (the config file every service reads)"), ClusterConfig,
              CONFIG_ALIASES, skip=NOT_FLAGS)
    # The model folder's default depends on $YUEBING_MODEL_DIR, so it is set here, not in the config.
    p.set_defaults(func=run, model=str(default_model_dir()))


def run(args: argparse.Namespace) -> int:
    refuse_unloadable_model(Path(args.model).resolve())
    config = from_args(ClusterConfig, args, CONFIG_ALIASES, skip=NOT_FLAGS)
    return up(from_args(UpOptions, args, LAYOUT_ALIASES, config=config))
