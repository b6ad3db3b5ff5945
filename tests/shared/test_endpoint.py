"""TCP endpoints: "tcp://host:port" both ways, an IPv6 address in brackets."""

import pytest

from shared.endpoint import parse_endpoint, tcp_endpoint


@pytest.mark.parametrize("host", ["127.0.0.1", "gateway-1", "::1"])
def test_an_endpoint_names_its_host_and_port_both_ways(host):
    assert parse_endpoint(tcp_endpoint(host, 8100)) == (host, 8100)
    assert tcp_endpoint("::1", 1) == "tcp://[::1]:1"


@pytest.mark.parametrize("bad", ["", "127.0.0.1:80", "http://h:80", "tcp://h", "tcp://h:0", "tcp://h:70000", "tcp://:80"])
def test_anything_else_is_refused(bad):
    with pytest.raises(ValueError):
        parse_endpoint(bad)
