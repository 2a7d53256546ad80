"""The relay chain's routes (``transports.net.relay.chain``) and where a relay listens, without
any host: the pool tests (``test_net_relay.py``) run them across network namespaces."""

from __future__ import annotations

from weightsync.transports.net.relay import UPSTREAM, chain, local_address_toward


def test_each_host_fetches_from_the_hosts_before_it_nearest_first():
    hosts = ["a", "b", "c", "d", "e"]
    relays = {h: f"10.0.0.{i}:7000" for i, h in enumerate(hosts)}
    routes = chain(hosts, relays)
    assert routes["a"] == []  # the first host: the trainer
    assert routes["b"] == [relays["a"]]
    assert routes["e"] == [relays["d"], relays["c"], relays["b"]][:UPSTREAM]


def test_a_host_whose_relay_is_unknown_is_passed_over():
    routes = chain(["a", "b", "c"], {"a": "10.0.0.1:1", "c": "10.0.0.3:1"})
    assert routes == {"a": [], "b": ["10.0.0.1:1"], "c": ["10.0.0.1:1"]}


def test_a_relay_listens_on_the_address_that_reaches_the_trainer():
    assert local_address_toward("127.0.0.1:29600") == "127.0.0.1"
