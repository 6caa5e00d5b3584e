"""anneal.dist.free_port: a local MASTER_PORT outside the kernel's ephemeral range, where the
outgoing connections of other jobs on the host (gloo's, the stores') cannot take it between the
choice and rank 0's bind."""

import socket

from anneal import dist


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    low = dist._ephemeral_low()
    ports = {dist.free_port() for _ in range(20)}
    assert all(dist._FIRST_PORT <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # chosen at random, not the same port for every caller
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_too_few_ports_below_the_range_fall_back_to_the_kernels_choice(monkeypatch):
    """A range that starts too low to sample from (here one taken port below it): the kernel's
    choice, never the taken port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(dist, "_FIRST_PORT", busy)
        monkeypatch.setattr(dist, "_ephemeral_low", lambda: busy + 1)
        assert dist.free_port() != busy  # too few to sample: the kernel's choice
