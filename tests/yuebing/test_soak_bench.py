"""The soak bench's judgement of requests: SLOs met, the run's tally, deaths counted."""

from yuebing import client
from yuebing.bench.soak import Served, Slo, deaths, met, summarize

SLO = Slo(ttft_s=1.0, tbt_s=0.1)


def streamed(ttft: float, gaps: list[float], status: int = 200) -> client.Streamed:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return client.Streamed(0.0, status=status, token_times=times)


def test_a_request_meets_its_slos_by_ttft_and_mean_time_between_tokens():
    assert met(streamed(0.5, [0.05, 0.05]), SLO) == (True, True)
    assert met(streamed(1.5, [0.05]), SLO) == (False, True)  # late first token
    assert met(streamed(0.5, [0.05, 0.3]), SLO) == (True, False)  # mean gap 0.175 s
    assert met(streamed(0.5, [], status=429), SLO) == (False, False)


def test_a_run_counts_kinds_timeouts_and_the_share_served_within_slo():
    served = [Served("ok", True, True), Served("ok", True, False), Served("429", False, False),
              Served("504", False, False), Served("connection", False, False)]
    r = summarize("x", 2.0, served)
    assert r.requests == 5 and r.kinds == {"ok": 2, "429": 1, "504": 1, "connection": 1}
    assert r.timeouts == 2 and r.slo_met == 0.5 and r.ttft_met == 1.0 and r.tbt_met == 0.5


def test_deaths_are_read_from_the_launchers_log(tmp_path):
    log = tmp_path / "up.log"
    log.write_text("[yuebing] ready\n[yuebing] decode-0 (pid 12) killed by SIGKILL; last lines\n"
                   "[yuebing] gateway (pid 9) exited with code 1; last lines\n")
    assert deaths(log) == 2
