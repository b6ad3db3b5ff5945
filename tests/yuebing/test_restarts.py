"""The restart policy: backoff that doubles, is capped, forgives old deaths, and
calls a crash loop a crash loop."""

from yuebing.restarts import RestartPolicy

POLICY = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, window_s=60.0, crash_loop=5)


def test_the_delay_doubles_with_each_recent_death_up_to_the_cap():
    deaths: list[float] = []
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0):
        deaths.append(t)
        delays.append(POLICY.delay(deaths, t))
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_so_many_deaths_in_the_window_is_a_crash_loop():
    assert POLICY.delay([0, 1, 2, 3, 4], 4) is None


def test_deaths_outside_the_window_are_forgiven():
    assert POLICY.delay([0, 1, 2, 3, 100], 100) == 0.5


def test_a_child_failing_the_same_way_in_a_row_is_given_up():
    policy = RestartPolicy(same_in_a_row=3)
    bind = "exited with code 1: OSError: [Errno 98] address already in use"
    assert not policy.gives_up([bind, bind])
    assert policy.gives_up(["exited with code 2: other", bind, bind, bind])
    assert not policy.gives_up([bind, "exited with code 1: another reason", bind])
    assert not policy.gives_up(["", "", ""])  # killed by signals: nothing said of the child itself
