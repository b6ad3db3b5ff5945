"""Who each process is on NATS, and what it may do there.

Every process connects as one identity (a user of the cluster's nats-server) and
may publish and subscribe only the subjects its job needs: a decode instance can
answer its own subject and stream tokens, but cannot read prompts sent to another
instance, answer the Conductor's subject or arm a messenger's fault switch.
`permissions` is the single table of that; yuebing/secrets.py turns it into the
server's configuration, and each process reads its own credentials file.

Replies travel on per-identity inboxes (`_INBOX.<name>.`), so that no identity can
subscribe to the answers meant for another.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from shared.config import check_id
from shared.messages import (
    BOOK_DIGESTS,
    CANCEL,
    CONDUCTOR_STATS,
    HEARTBEAT,
    KV_EVENTS,
    PREFIX,
    SCHEDULE,
    decode_subject,
    messenger_faults_subject,
    messenger_subject,
    prefill_subject,
    stream_subject,
    updates_subject,
)
from shared.private_file import read_private

IdentityRole = Literal["gateway", "conductor", "prefill", "decode", "messenger", "admin", "auth"]
ROLES: tuple[IdentityRole, ...] = ("gateway", "conductor", "prefill", "decode", "messenger", "admin", "auth")
AUTH_CALLOUT = "$SYS.REQ.USER.AUTH"  # where nats-server asks the auth callout (services/nats_auth/)

ANY_PREFILL = prefill_subject("*")
ANY_DECODE = decode_subject("*")
ANY_MESSENGER = messenger_subject("*")  # one token: not a messenger's faults subject (admin only)
ANY_STREAM = stream_subject("*")
ANY_UPDATES = updates_subject("*")  # one token: any Conductor's


@dataclass(frozen=True)
class Identity:
    """One NATS user: a singleton service (gateway, conductor, admin) or an instance."""

    name: str
    role: IdentityRole
    node: str = ""  # a messenger's node: the subject it answers

    def __post_init__(self) -> None:
        check_id(self.name, "identity")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; one of {', '.join(ROLES)}")
        if self.role == "messenger":
            check_id(self.node, "node")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool  # may answer the requests it receives (on the asker's inbox)


def inbox_prefix(name: str) -> str:
    return f"_INBOX.{name}"


RESPONSES_BUCKET = "yuebing_responses"  # JetStream's key-value bucket of stored Responses (services/gateway/response_store.py)


def bucket_subjects(bucket: str) -> tuple[str, ...]:
    """What a client of one JetStream key-value bucket publishes: its JetStream API
    calls (look it up, make it, read an entry) and its entries' own subjects."""
    stream = f"KV_{bucket}"
    return (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$KV.{bucket}.>")


def permissions(identity: Identity) -> Permissions:
    """What `identity` may publish and subscribe: the subjects its code uses, no more."""
    inbox = f"{inbox_prefix(identity.name)}.>"
    own = {
        "gateway": Permissions(
            publish=(SCHEDULE, ANY_PREFILL, ANY_DECODE, CANCEL, ANY_UPDATES, *bucket_subjects(RESPONSES_BUCKET)),
            subscribe=(HEARTBEAT, ANY_STREAM),
            allow_responses=False,
        ),
        "conductor": Permissions(
            publish=(ANY_MESSENGER, BOOK_DIGESTS),  # pool snapshots; its books' news, for the other Conductors
            # Its own updates subject is named by its --instance-id, which need not be its identity's name.
            subscribe=(SCHEDULE, CONDUCTOR_STATS, HEARTBEAT, ANY_UPDATES, KV_EVENTS, BOOK_DIGESTS),
            allow_responses=True,
        ),
        # A prefill instance decodes too while no decode instance is live (the
        # Conductor's fallback): its decode subject, and the streams it answers on.
        "prefill": Permissions(
            publish=(HEARTBEAT, ANY_UPDATES, ANY_MESSENGER, ANY_STREAM),  # messengers: pulls of remote blocks
            subscribe=(prefill_subject(identity.name), decode_subject(identity.name), CANCEL),
            allow_responses=True,
        ),
        # A decode instance prefills too once the planner moves it (services/conductor/roles.py).
        "decode": Permissions(
            publish=(HEARTBEAT, ANY_STREAM, ANY_UPDATES, ANY_MESSENGER),
            subscribe=(decode_subject(identity.name), prefill_subject(identity.name), CANCEL),
            allow_responses=True,
        ),
        "messenger": Permissions(
            publish=(HEARTBEAT, KV_EVENTS),
            subscribe=(HEARTBEAT, CANCEL, messenger_subject(identity.node), messenger_faults_subject(identity.node)),
            allow_responses=True,
        ),
        "admin": Permissions(publish=(f"{PREFIX}.>",), subscribe=(f"{PREFIX}.>",), allow_responses=True),
        # The auth callout: it hears the servers' authorization requests and answers them.
        "auth": Permissions(publish=(), subscribe=(AUTH_CALLOUT,), allow_responses=True),
    }[identity.role]
    return Permissions(own.publish, (*own.subscribe, inbox), own.allow_responses)


class NatsCredentials(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One identity's credentials file (written 0600 by `yuebing secrets`)."""

    user: str
    password: str = ""
    ca_file: str = ""  # set when the server speaks TLS: its CA, to verify it
    # Instead of a password: a file holding the pod's Kubernetes ServiceAccount token,
    # read at each (re)connect (the kubelet keeps it fresh), for the auth callout to check.
    token_file: str = ""

    def secret(self) -> str | Callable[[], str]:
        """What goes as the password: the password, or a reader of the token file."""
        if not self.token_file:
            return self.password
        path = self.token_file
        return lambda: Path(path).read_text().strip()

    def tls(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None


def load_credentials(path: str) -> NatsCredentials:
    """An owner-only credentials file, or a ValueError that says what is wrong."""
    try:
        return msgspec.json.decode(read_private(path), type=NatsCredentials)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"NATS credentials {path}: {e}") from e
