"""Fault injection only where the messenger was started for it (--fault-injection),
and only on its own NATS subject, which NATS opens to the admin identity alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.messenger.app import MessengerService
from shared.messages import MessengerAck, MessengerCommand, MessengerStats, decode, messenger_faults_subject
from tests.messenger.nodes import start
from tests.messenger.test_metrics import page

ARM = MessengerCommand(op="fault", corrupt_next=2, no_room_next=1)


@dataclass
class Request:
    """A NATS request's reply side."""

    replies: list[bytes] = field(default_factory=list)

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


def test_without_the_flag_fault_commands_are_refused_and_counted(tmp_path):
    m = start(tmp_path)
    reply = m.arm_faults(corrupt_next=2, no_room_next=1)
    assert isinstance(reply, MessengerAck) and not reply.ok and "--fault-injection" in reply.error
    assert (m.node.faults.corrupt_next, m.node.faults.no_room_next) == (0, 0)
    security = m.security()
    assert (security.fault_commands_refused, security.fault_injection_enabled) == (1, False)
    samples = page(m.stats(), security)
    assert samples[("yuebing_messenger_fault_injection_enabled", (("node", "n"),))] == 0
    assert samples[("yuebing_messenger_fault_commands_refused_total", (("node", "n"),))] == 1


def test_with_the_flag_fault_commands_arm_the_switches(tmp_path):
    m = start(tmp_path, fault_injection=True)
    reply = m.arm_faults(corrupt_next=2, no_room_next=-5)
    assert isinstance(reply, MessengerStats) and (reply.corrupt_pending, reply.no_room_pending) == (2, 0)
    assert page(m.stats(), m.security())[("yuebing_messenger_fault_injection_enabled", (("node", "n"),))] == 1


async def test_fault_commands_are_taken_on_the_faults_subject_only(tmp_path):
    m = start(tmp_path, fault_injection=True)
    service = MessengerService(m, sockets=None)
    on_control, on_faults = Request(), Request()
    await service.on_command(ARM, on_control)  # the control subject, which every prefill may publish to
    (refused,) = on_control.replies
    assert messenger_faults_subject("n") in decode(refused, MessengerAck).error
    assert m.node.faults.corrupt_next == 0
    await service.on_faults(ARM, on_faults)
    assert decode(on_faults.replies[0], MessengerStats).corrupt_pending == 2
    await service.on_faults(MessengerCommand(op="stats"), on_faults)
    assert not decode(on_faults.replies[1], MessengerAck).ok
