"""`yuebing up`'s supervision of its children, on real (tiny) processes."""

import json
import signal
import socket
import sys
import time

import pytest

from shared.config import DEFAULT_PROFILE, ClusterConfig
from shared.model_identity import fingerprint
from yuebing import process
from yuebing.launcher import Child, Cluster, UpOptions, api_key, child_environment, make_secrets
from yuebing.secrets import Listen, Peer
from yuebing.restarts import RestartPolicy

EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]
FAST = RestartPolicy(first_delay_s=0.01, max_delay_s=0.05, window_s=60.0, crash_loop=3)


def cluster(policy: RestartPolicy = FAST) -> Cluster:
    return Cluster(UpOptions(config=ClusterConfig()), policy=policy)


def supervise_until(c: Cluster, done, timeout_s: float = 30.0) -> list[str]:
    """Run the supervisor's checks until `done()`; the crash loops it saw."""
    deadline = time.monotonic() + timeout_s
    looping: list[str] = []
    while not done():
        assert time.monotonic() < deadline, "supervisor did not get there"
        looping += c.check_children()
        time.sleep(0.02)
    return looping


def test_a_dead_child_is_started_again_after_its_backoff(tmp_path, capsys):
    c = cluster()
    conductor = Child("conductor", EXIT_3, tmp_path / "conductor.log")
    c.children = [conductor]
    c.launch(conductor)
    first_pid = conductor.process.pid
    assert supervise_until(c, lambda: conductor.restarts == 2) == []
    assert conductor.process.pid != first_pid and not c.failed
    err = capsys.readouterr().err
    assert "conductor (pid" in err and "exited with code 3" in err and "restarting conductor in" in err


def test_a_crash_loop_stops_the_cluster_and_says_which_child(tmp_path, capsys):
    c = cluster()
    gateway = Child("gateway", EXIT_3, tmp_path / "gateway.log")
    c.children = [gateway]
    c.launch(gateway)
    assert supervise_until(c, lambda: c.failed) == ["gateway"]
    assert c.stopping and len(gateway.deaths) == FAST.crash_loop
    assert "gateway died 3 times in 60s: a crash loop" in capsys.readouterr().err


PATIENT = RestartPolicy(first_delay_s=0.01, max_delay_s=0.05, window_s=60.0, crash_loop=10, same_in_a_row=3)
# Binds the port after --metrics-port, as a service's metrics page does, and serves on.
BINDS = [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
         "s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--metrics-port') + 1]))); s.listen(); "
         "print('bound', flush=True); time.sleep(60)"]


def test_a_child_whose_metrics_port_was_taken_starts_again_on_a_free_one(tmp_path, capsys):
    c = cluster(PATIENT)
    c.options = UpOptions(config=ClusterConfig(), ready_file=tmp_path / "ready.json")
    with socket.socket() as thief:  # another program took the port the launcher drew
        thief.bind(("127.0.0.1", 0))
        taken = thief.getsockname()[1]
        conductor = Child("conductor", [*BINDS, "--metrics-port", str(taken)], tmp_path / "conductor.log")
        c.children, c.metrics = [conductor], {"conductor": f"http://127.0.0.1:{taken}/metrics"}
        c.ready = {"metrics": dict(c.metrics)}
        c.launch(conductor)
        supervise_until(c, lambda: conductor.restarts == 1 and "bound" in process.tail(conductor.log_path, 1))
        port = int(conductor.argv[-1])
        assert port != taken and conductor.process.poll() is None and not conductor.failed
        assert c.metrics["conductor"] == f"http://127.0.0.1:{port}/metrics"
        assert json.loads((tmp_path / "ready.json").read_text())["metrics"]["conductor"] == c.metrics["conductor"]
    assert f"conductor's metrics port {taken} is taken: it starts again on {port}" in capsys.readouterr().err
    c.stop(grace_s=2)


EXIT_1_SAYING = [sys.executable, "-c", "import sys; print('cannot start: a reason'); sys.exit(1)"]


def test_an_engine_failing_the_same_way_in_a_row_is_marked_failed_in_one_line_and_the_rest_serves_on(tmp_path, capsys):
    c = cluster(PATIENT)
    decode = Child("decode-1", EXIT_1_SAYING, tmp_path / "decode-1.log")
    c.children = [decode]
    c.launch(decode)
    assert supervise_until(c, lambda: decode.failed) == []
    assert not c.stopping and len(decode.deaths) == 3
    supervise_until(c, lambda: True)
    assert len(decode.deaths) == 3  # not started again
    err = capsys.readouterr().err
    assert "decode-1 failed 3 times in a row the same way (exited with code 1: cannot start: a reason); " \
           "not starting it again" in err


def test_a_required_child_failing_the_same_way_stops_the_cluster(tmp_path):
    c = cluster(PATIENT)
    conductor = Child("conductor", EXIT_1_SAYING, tmp_path / "conductor.log")
    c.children = [conductor]
    c.launch(conductor)
    assert supervise_until(c, lambda: c.stopping) == ["conductor"]
    assert c.failed and conductor.failed


IGNORES_TERM = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(60)"]


def test_stop_kills_a_child_that_ignores_sigterm_and_says_so(tmp_path, capsys):
    c = cluster()
    child = Child("gateway", IGNORES_TERM, tmp_path / "gateway.log")
    c.children = [child]
    c.launch(child)
    deadline = time.monotonic() + 10
    while "up" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    c.stop(grace_s=0.3)
    assert child.process.returncode == -signal.SIGKILL
    assert "gateway did not stop in 0s; killed it" in capsys.readouterr().err


def test_the_run_config_has_this_runs_nats_url_kv_folder_and_weights(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"hidden_size": 8}')
    # A profile named: this folder is no model to profile (tests/yuebing/test_profile_cache.py).
    c = Cluster(UpOptions(config=ClusterConfig(model=str(model_dir), kv_dir=str(tmp_path / "kv"), pool_bytes=64 << 20,
                                               profile=str(DEFAULT_PROFILE))))
    config = c.config(tmp_path, "nats://127.0.0.1:4333")
    assert config.nats_url == "nats://127.0.0.1:4333" and config.kv_dir == str(tmp_path / "kv")
    assert config.pool_bytes == 64 << 20 and c.kv_dir == tmp_path / "kv"
    assert config.model_fingerprint == fingerprint(model_dir) and config.model_fingerprint.encode() in config.model_salt


def test_each_child_logs_in_as_itself_and_only_the_gateway_gets_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("YUEBING_API_KEY", "sesame")
    options = UpOptions(config=ClusterConfig(), prefill=2, nodes=2, fault_injection=True)
    c = Cluster(options)
    secrets = make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333))
    c.plan(tmp_path, tmp_path / "cluster.json", secrets)
    argv = {child.name: child.argv for child in c.children}
    assert argv["nats"][-2:] == ["-c", str(secrets.nats_config)]
    for name in ("gateway", "conductor", "prefill-0", "prefill-1", "decode-0", "messenger-0", "messenger-1"):
        flag = argv[name].index("--nats-credentials")
        assert argv[name][flag + 1] == str(secrets.credentials(name)) and secrets.credentials(name).exists()
    assert argv["gateway"][argv["gateway"].index("--api-key-file") + 1] == str(secrets.api_key)
    assert secrets.api_key.read_text() == "sesame"
    assert not any("sesame" in arg for args in argv.values() for arg in args)
    assert "--fault-injection" in argv["messenger-1"] and "--fault-injection" not in argv["prefill-0"]
    assert argv["messenger-0"][argv["messenger-0"].index("--kv-key-file") + 1] == str(secrets.kv_key)
    assert not any("kv.key" in arg for name in ("gateway", "prefill-0", "decode-0") for arg in argv[name])
    assert "YUEBING_API_KEY" not in child_environment()


def test_the_api_key_file_must_be_private(tmp_path):
    key = tmp_path / "key"
    key.write_text("sesame\n")
    key.chmod(0o644)
    with pytest.raises(PermissionError, match="open to others"):
        api_key(key)
    key.chmod(0o600)
    assert api_key(key) == "sesame"


def test_a_kv_transport_that_cannot_load_stops_the_cluster_before_anything_starts(tmp_path, monkeypatch):
    from tests.messenger.test_mooncake_transport import hide_mooncake

    hide_mooncake(monkeypatch)
    c = Cluster(UpOptions(config=ClusterConfig(kv_transport="mooncake"), run_dir=tmp_path / "run"))
    with pytest.raises(RuntimeError, match="libibverbs1.*--kv-transport zmq"):
        c.start()
    assert not (tmp_path / "run").exists() and not c.children  # nothing planned, nothing started


def test_colocated_runs_as_many_engines_all_as_instances_that_prefill_and_decode(tmp_path):
    options = UpOptions(config=ClusterConfig(mode="colocated"), prefill=1, decode=1)
    c = Cluster(options)
    c.plan(tmp_path, tmp_path / "cluster.json", make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333)))
    engines = sorted(child.name for child in c.children if child.name.split("-")[0] in ("prefill", "decode"))
    assert engines == ["decode-0", "decode-1"]
    assert options.layout().startswith("2 colocated")
    assert UpOptions(config=ClusterConfig(mode="colocated"), prefill=0, decode=1).instances == (0, 1)


@pytest.mark.parametrize(("mode", "prefill", "error"), [
    ("split", 1, "unknown --mode"), ("conditional", 0, "needs at least one prefill"),
    ("disaggregated", 0, "adaptive mode runs without"),
])
def test_a_layout_the_mode_cannot_serve_is_refused(mode, prefill, error):
    with pytest.raises(ValueError, match=error):
        UpOptions(config=ClusterConfig(mode=mode), prefill=prefill)


def test_adaptive_mode_runs_a_pooled_fleet_of_decode_instances(tmp_path):
    options = UpOptions(config=ClusterConfig(mode="adaptive"), prefill=0, decode=2)
    c = Cluster(options)
    c.plan(tmp_path, tmp_path / "cluster.json", make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333)))
    engines = sorted(child.name for child in c.children if child.name.split("-")[0] in ("prefill", "decode"))
    assert engines == ["decode-0", "decode-1"] and options.instances == (0, 2)


def test_cpp_groups_are_prefill_instances_after_the_singles_each_told_its_stages(tmp_path):
    options = UpOptions(config=ClusterConfig(), prefill=1, cpp_groups=1, cpp_stages=3, decode=1)
    c = Cluster(options)
    c.plan(tmp_path, tmp_path / "cluster.json", make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333)))
    argv = {child.name: child.argv for child in c.children}
    assert "--stages" not in argv["prefill-0"]
    assert argv["prefill-1"][argv["prefill-1"].index("--stages") + 1] == "3"
    assert (tmp_path / "secrets" / "prefill-1.nats.json").exists()  # the group logs in as a prefill instance
    assert "1 as CPP groups of 3 stages" in options.layout()
    assert UpOptions(config=ClusterConfig(), prefill=0, cpp_groups=1).instances == (1, 1)  # a group alone is enough


@pytest.mark.parametrize(("flags", "error"), [
    ({"cpp_groups": -1}, "--cpp-groups must not be negative"),
    ({"cpp_groups": 1, "cpp_stages": 1}, "--cpp-stages at least 2"),
    ({"cpp_groups": 1, "config": ClusterConfig(mode="colocated")}, "colocated has none"),
])
def test_a_cpp_layout_that_cannot_run_is_refused(flags, error):
    with pytest.raises(ValueError, match=error):
        UpOptions(**{"config": ClusterConfig(), **flags})


def test_more_gpus_asked_than_listed_stops_the_cluster_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr("yuebing.gpus.listed_gpus", lambda: ["0", "1"])
    c = Cluster(UpOptions(config=ClusterConfig(), prefill=2, decode=2, run_dir=tmp_path / "run"))
    with pytest.raises(ValueError, match="need 4 GPUs .* but 2 are available"):
        c.start()
    assert not (tmp_path / "run").exists() and not c.children


def test_cpu_kv_caches_beyond_the_machine_stop_the_cluster_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr("yuebing.gpus.listed_gpus", lambda: [])
    monkeypatch.setattr("yuebing.launcher.memory_total", lambda: 8 << 30)
    c = Cluster(UpOptions(config=ClusterConfig(kv_cache_gib=4), prefill=1, decode=1, run_dir=tmp_path / "run"))
    with pytest.raises(ValueError, match=r"need 8\.5 GiB; this machine has 8\.0 GiB"):
        c.start()
    assert not (tmp_path / "run").exists() and not c.children


def test_each_engine_child_starts_seeing_only_its_own_gpus(tmp_path):
    from yuebing import gpus

    options = UpOptions(config=ClusterConfig(), prefill=1, decode=2)
    c = Cluster(options)
    c.plan(tmp_path, tmp_path / "cluster.json", make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333)))
    c.give_gpus(gpus.assign(options.gpu_needs(), ["3", "5", "7"]))
    seen = {child.name: child.env.get("CUDA_VISIBLE_DEVICES") for child in c.children}
    assert seen["prefill-0"] == "3" and seen["decode-0"] == "5" and seen["decode-1"] == "7"
    assert seen["gateway"] is None and seen["messenger-0"] is None
    probe = Child("decode-0", [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                  tmp_path / "probe.log", env=c.children[[ch.name for ch in c.children].index("decode-0")].env)
    c.env = {"PATH": "/usr/bin:/bin"}
    c.launch(probe)
    assert probe.process is not None and probe.process.wait(10) == 0
    assert probe.log_path.read_text().strip().endswith("5")


def test_a_port_another_program_holds_is_named_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        c = Cluster(UpOptions(config=ClusterConfig(), port=port, run_dir=tmp_path / "run"))
        with pytest.raises(ValueError, match=f"port {port} .* is in use by another program: choose another with --port"):
            c.start()
        c = Cluster(UpOptions(config=ClusterConfig(), nats_port=port, run_dir=tmp_path / "run"))
        with pytest.raises(ValueError, match="--nats-port"):
            c.start()
    assert not (tmp_path / "run").exists() and not c.children


def test_a_second_launcher_on_a_run_folder_in_use_is_refused_naming_the_first(tmp_path):
    import os

    from yuebing.launcher import lock_run_dir

    held = lock_run_dir(tmp_path)
    with pytest.raises(ValueError, match=f"another yuebing up \\(pid {os.getpid()}\\) is using run folder"):
        lock_run_dir(tmp_path)
    os.close(held)  # the first launcher gone: the folder is free again
    os.close(lock_run_dir(tmp_path))


def test_a_run_folder_used_before_gets_new_secrets_and_loses_its_stale_ready_file(tmp_path):
    from yuebing.launcher import clear_last_run

    options = UpOptions(config=ClusterConfig())
    first = make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333)).kv_key.read_bytes()
    ready = tmp_path / "ready.json"
    ready.write_text('{"url": "http://127.0.0.1:1/v1"}')  # the last run's, its cluster gone
    clear_last_run(tmp_path, ready)
    second = make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333))  # refused before: the files existed
    assert not ready.exists() and second.kv_key.read_bytes() != first
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "secrets").rename(tmp_path / "elsewhere" / "secrets")
    (tmp_path / "secrets").symlink_to(tmp_path / "elsewhere" / "secrets")
    with pytest.raises(ValueError, match="symbolic link"):
        clear_last_run(tmp_path, None)
    assert (tmp_path / "elsewhere" / "secrets").is_dir()


def test_gateways_serve_side_by_side_on_consecutive_ports_logged_in_as_the_gateway(tmp_path):
    options = UpOptions(config=ClusterConfig(), gateways=3, port=8100)
    c = Cluster(options)
    secrets = make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333))
    c.plan(tmp_path, tmp_path / "cluster.json", secrets)
    argv = {child.name: child.argv for child in c.children}
    for name, port in (("gateway", 8100), ("gateway-1", 8101), ("gateway-2", 8102)):
        assert argv[name][argv[name].index("--port") + 1] == str(port)
        assert argv[name][argv[name].index("--nats-credentials") + 1] == str(secrets.credentials("gateway"))
    assert c.urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert c.metrics["gateway-2"] == "http://127.0.0.1:8102/metrics"
    with pytest.raises(ValueError, match="--gateways"):
        UpOptions(config=ClusterConfig(), gateways=0)


def test_a_taken_port_of_a_later_gateway_is_named(tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        c = Cluster(UpOptions(config=ClusterConfig(), port=port - 1, gateways=2, run_dir=tmp_path / "run"))
        with pytest.raises(ValueError, match=r"gateway 1 takes --port\+1"):
            c.start()


def test_a_nats_cluster_is_three_servers_on_one_file_each_told_its_name_ports_and_folder(tmp_path):
    options = UpOptions(config=ClusterConfig(), nats_servers=3)
    peers = (Peer("127.0.0.1", 4333, 6333), Peer("127.0.0.1", 4334, 6334), Peer("127.0.0.1", 4335, 6335))
    c = Cluster(options, nats_peers=list(peers))
    secrets = make_secrets(tmp_path / "secrets", options, Listen("127.0.0.1", 4333, cluster=peers))
    c.plan(tmp_path, tmp_path / "cluster.json", secrets)
    servers = {child.name: child for child in c.children if child.name.startswith("nats")}
    assert sorted(servers) == ["nats", "nats-1", "nats-2"]
    assert {tuple(s.argv[1:]) for s in servers.values()} == {("-c", str(secrets.nats_config))}
    assert [(s.env["NATS_SERVER_NAME"], s.env["NATS_PORT"], s.env["NATS_ROUTE_PORT"]) for s in servers.values()] == [
        ("nats", "4333", "6333"), ("nats-1", "4334", "6334"), ("nats-2", "4335", "6335")]
    assert len({s.env["NATS_STORE_DIR"] for s in servers.values()}) == 3  # JetStream's files apart
    assert secrets.nats_url == "nats://127.0.0.1:4333,nats://127.0.0.1:4334,nats://127.0.0.1:4335"
    with pytest.raises(ValueError, match="--nats-servers"):
        UpOptions(config=ClusterConfig(), nats_servers=0)
