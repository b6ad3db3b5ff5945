"""`yuebing up`'s supervision of its children, on real (tiny) processes."""

import signal
import sys
import time

from shared.config import ClusterConfig
from yuebing.launcher import MAX_RESTARTS, Child, Cluster, UpOptions

EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]


def cluster() -> Cluster:
    return Cluster(UpOptions(config=ClusterConfig()))


def wait_exit(child: Child) -> None:
    child.process.wait(timeout=10)


def test_a_restarted_child_is_not_reported_dead_and_others_are(tmp_path):
    c = cluster()
    conductor = Child("conductor", EXIT_3, tmp_path / "conductor.log", critical=False, restart=True)
    helper = Child("helper", EXIT_3, tmp_path / "helper.log", critical=False)
    c.children = [conductor, helper]
    for child in c.children:
        c.launch(child)
        wait_exit(child)
    first_pid = conductor.process.pid
    # The conductor died during start-up: restarted, so start-up goes on; the helper stays dead.
    assert c.check_children() == ["helper"]
    assert conductor.restarts == 1 and conductor.process.pid != first_pid and not c.failed


def test_a_child_that_keeps_dying_is_dead_after_its_restarts(tmp_path):
    c = cluster()
    child = Child("conductor", EXIT_3, tmp_path / "conductor.log", critical=False, restart=True)
    c.children = [child]
    c.launch(child)
    dead: list[str] = []
    deadline = time.monotonic() + 30
    while not dead and time.monotonic() < deadline:
        wait_exit(child)
        dead = c.check_children()
    assert dead == ["conductor"] and child.restarts == MAX_RESTARTS


def test_a_required_child_that_dies_stops_the_cluster(tmp_path):
    c = cluster()
    gateway = Child("gateway", EXIT_3, tmp_path / "gateway.log", critical=True)
    c.children = [gateway]
    c.launch(gateway)
    wait_exit(gateway)
    assert c.check_children() == ["gateway"] and c.failed and c.stopping


IGNORES_TERM = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(60)"]


def test_stop_kills_a_child_that_ignores_sigterm_and_says_so(tmp_path, capsys):
    c = cluster()
    child = Child("gateway", IGNORES_TERM, tmp_path / "gateway.log", critical=True)
    c.children = [child]
    c.launch(child)
    deadline = time.monotonic() + 10
    while "up" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    c.stop(grace_s=0.3)
    assert child.process.returncode == -signal.SIGKILL
    assert "gateway did not stop in 0s; killed it" in capsys.readouterr().err


def test_the_run_config_has_this_runs_nats_port_and_kv_folder(tmp_path):
    c = Cluster(UpOptions(config=ClusterConfig(kv_dir=str(tmp_path / "kv"), pool_bytes=64 << 20)))
    config = c.config(tmp_path, nats_port=4333)
    assert config.nats_url == "nats://127.0.0.1:4333" and config.kv_dir == str(tmp_path / "kv")
    assert config.pool_bytes == 64 << 20 and c.kv_dir == tmp_path / "kv"
