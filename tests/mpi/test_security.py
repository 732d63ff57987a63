"""What docs/security.md promises: under real mpirun at 1, 2 and 3 ranks, the rendezvous TCPStore
of init_process_group("mlfabric") listens on the loopback only (one host), and
broadcast_object / allgather_object with serializer="plain" never unpickle and refuse other
objects on the sender with an error on every rank (tests/mpi_cases/security_cases.py); in
process, the plain format's decoder against malformed and hostile bytes."""
import random

import pytest

from tests.mpi_util import run_cases

torch = pytest.importorskip("torch")
F = pytest.importorskip("mlfabric.torch.functions")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_security_cases(n):
    run_cases("security_cases", n, timeout=180)


def _bytes(obj):
    words, nbytes = F._to_words(obj, "plain")
    return words.numpy().tobytes()[:nbytes]


PLAIN = [None, True, False, 0, -1, 2 ** 100, -2 ** 70, 1.5, float("inf"), "", "h\u00e9\ud800",
         b"\x00\xff", [1, (2, 3), {"a": [None]}], {1: 2, (1, "x"): b"", None: False}, [], (), {}]


@pytest.mark.parametrize("obj", PLAIN, ids=range(len(PLAIN)))
def test_plain_round_trip_keeps_values_and_types(obj):
    got = F._plain_decode(_bytes(obj))
    assert got == obj and type(got) is type(obj)
    if isinstance(obj, (list, tuple)):
        assert [type(v) for v in got] == [type(v) for v in obj]


def test_plain_refuses_subclasses_and_other_types():
    import collections
    for bad in (bytearray(b"x"), collections.OrderedDict(a=1), 1j, {1, 2}, torch.ones(1),
                type("S", (str,), {})("s")):
        with pytest.raises(TypeError, match="serializer='plain' takes"):
            _bytes([bad])


def test_plain_decoder_rejects_malformed_bytes_with_value_errors():
    data = _bytes([1, "abc", {"k": (1.0, b"zz")}, 2 ** 80])
    rng = random.Random(0)
    for _ in range(2000):
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(F._PLAIN_MAGIC), len(d))] = rng.randrange(256)
        d = bytes(d[:rng.randint(len(F._PLAIN_MAGIC), len(d))])
        try:
            F._plain_decode(d)
        except ValueError:
            pass


def test_plain_decoder_bounds_what_a_hostile_peer_can_ask_for():
    magic, length = F._PLAIN_MAGIC, F._LEN.pack
    with pytest.raises(ValueError, match="truncated"):       # a list of 2**60 items
        F._plain_decode(magic + b"l" + length(1 << 60))
    with pytest.raises(ValueError, match="truncated"):       # a string of 2**60 bytes
        F._plain_decode(magic + b"s" + length(1 << 60))
    with pytest.raises(ValueError, match="nested more than"):  # deeper than the limit
        F._plain_decode(magic + (b"l" + length(1)) * 10000 + b"N")
    with pytest.raises(ValueError, match="unhashable"):       # a list as a dict key
        F._plain_decode(magic + b"d" + length(1) + b"l" + length(0) + b"N")
    with pytest.raises(ValueError, match="stray"):
        F._plain_decode(_bytes(1) + b"N")
    with pytest.raises(ValueError, match="unknown tag"):
        F._plain_decode(magic + b"c")
    with pytest.raises(F.MismatchError, match="not in the plain format"):
        F._plain_decode(F._to_words([1])[0].numpy().tobytes())  # a pickle is never loaded


# --- where the rendezvous store listens across hosts (rank 0's view, in process) -------------------

class _FakeComm:
    """Rank 0's side of the three collectives _store_address makes."""

    def __init__(self, hosts, gathered):
        self.hosts, self.gathered = hosts, gathered

    def allgather(self, _):
        return self.hosts

    def gather(self, _, root=0):
        return self.gathered

    def bcast(self, value, root=0):
        return value


def _outward_address():
    """An address of this host that is not the loopback (the one it routes from), or None."""
    backend = pytest.importorskip("mlfabric.torch.backend")
    addr = backend._route_from("192.0.2.200") or backend._route_from("10.255.255.1")
    return addr if addr and not addr.startswith("127.") else None


def test_store_address_across_hosts(monkeypatch):
    backend = pytest.importorskip("mlfabric.torch.backend")
    monkeypatch.delenv("MLFABRIC_STORE_ADDR", raising=False)
    assert backend._store_address(None, 0, True) == ("127.0.0.1", "127.0.0.1")
    mine = _outward_address()
    if mine is None:
        pytest.skip("this host has no address but the loopback")
    # a peer on another host says it reaches rank 0 from `mine` (here: this host itself), so
    # rank 0 listens on the address it routes from towards it, and the peers connect there
    comm = _FakeComm(["h0", "h0", "h1"], ["", "", mine])
    assert backend._store_address(comm, 0, False) == (mine, mine)
    # a peer that cannot tell its route: no single address, all interfaces, host name to connect
    comm = _FakeComm(["h0", "h1"], ["", None])
    assert backend._store_address(comm, 0, False) == (None, "h0")
    monkeypatch.setenv("MLFABRIC_STORE_ADDR", mine)
    assert backend._store_address(comm, 0, False) == (mine, mine)


def test_listening_socket_is_bound_to_the_address_given():
    import os
    import socket
    backend = pytest.importorskip("mlfabric.torch.backend")
    fd, port = backend._listening_socket("127.0.0.1")
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            assert sock.getsockname() == ("127.0.0.1", port)
    finally:
        os.close(fd)
