"""Multi-rank cases of what docs/security.md promises: the rendezvous TCPStore of
init_process_group("mlfabric") listens on the loopback only when the job runs on one host, and
broadcast_object / allgather_object with serializer="plain" move plain data without ever
unpickling, refusing anything else on the sender with an error on every rank (never a wait).

The bad rank is the last one (the root, rank 0, is not it unless there is one rank)."""
import os

import pytest
import torch
import torch.distributed as dist

import mlfabric.torch as hvd
from mlfabric.torch import backend

TRIPPED = "MLFABRIC_TEST_UNPICKLED"


def setup():
    torch.set_num_threads(1)  # the ranks share the machine's cores
    for var in backend._ENV_VARS:  # MPI supplies ranks and store
        os.environ.pop(var, None)
    dist.init_process_group("mlfabric")
    hvd.init()


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


def _still_in_step():
    n = hvd.size()
    assert hvd.allreduce(torch.ones(5), op=hvd.Sum).tolist() == [n] * 5


# --- the rendezvous store ------------------------------------------------------------------------

def _own_socket_inodes():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr):
    """/proc/net/tcp{,6}'s local address (hex, host byte order per 32-bit word) as text."""
    import ipaddress
    import struct
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                     for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(port):
    """The addresses this process listens on at `port` (TCP, v4 and v6)."""
    mine, found = _own_socket_inodes(), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and fields[9] in mine:
                found.append(_address(addr))
    return found


def case_rendezvous_store_listens_on_the_loopback_only():
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    assert isinstance(store, dist.TCPStore), type(store)
    # it serves every rank (before the check below, which only rank 0 makes: a rank that
    # failed it must not leave the others waiting for its key)
    store.set(f"security.{hvd.rank()}", str(hvd.rank()))
    assert [store.get(f"security.{q}") for q in range(hvd.size())] == \
        [str(q).encode() for q in range(hvd.size())]
    if hvd.rank() == 0:
        where = _listening(store.port)
        assert where == ["127.0.0.1"], (f"the store (port {store.port}) listens on {where}; "
                                        "one host: the loopback only")


# --- objects: the plain serializer ---------------------------------------------------------------

def _plain(r):
    return {"rank": r, "none": None, "flags": (True, False), "big": 2 ** 70 + r, "f": r / 3,
            "s": "é" * r, "b": bytes(range(r)), "nested": [[r, (r,)], {r: [b"x"]}], 7: "int key"}


def case_plain_objects_move_as_they_are():
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        got = hvd.broadcast_object(_plain(r), root_rank=root, serializer="plain")
        assert got == _plain(root) and type(got["flags"]) is tuple, got
    every = hvd.allgather_object(_plain(r), serializer="plain")
    assert every == [_plain(q) for q in range(n)]
    assert hvd.allgather_object(r if r % 2 else str(r), serializer="plain") == \
        [q if q % 2 else str(q) for q in range(n)]
    assert hvd.broadcast_object(None if r else [], 0, serializer="plain") == []


def _expect(bad_call, good_call, bad_error, bad_match, others_error, others_match):
    n, r = hvd.size(), hvd.rank()
    if r == n - 1:
        with pytest.raises(bad_error, match=bad_match) as info:
            bad_call()
        assert not isinstance(info.value, hvd.PeerTimeoutError), info.value
    else:
        with pytest.raises(others_error, match=others_match) as info:
            good_call()
        assert not isinstance(info.value, hvd.PeerTimeoutError), info.value
    _still_in_step()


class Opaque:
    pass


def case_plain_refuses_other_objects_on_the_sender_and_every_rank_hears():
    n = hvd.size()
    bad = n - 1
    obj = {"ok": [1, 2], "model": [0, Opaque()]}
    _expect(lambda: hvd.broadcast_object(obj, root_rank=bad, serializer="plain"),
            lambda: hvd.broadcast_object(None, root_rank=bad, serializer="plain"),
            TypeError, r"obj\['model'\]\[1\] is a .*Opaque; serializer='plain' takes",
            hvd.MlfabricError, rf"root rank {bad} could not encode")
    _expect(lambda: hvd.allgather_object({1j: 1}, serializer="plain"),
            lambda: hvd.allgather_object({1: 1}, serializer="plain"),
            TypeError, r"has a key that is a builtins.complex",
            hvd.MlfabricError, rf"rank\(s\) \[{bad}\] could not encode")
    looped = []
    looped.append(looped)
    _expect(lambda: hvd.allgather_object(looped, serializer="plain"),
            lambda: hvd.allgather_object([], serializer="plain"),
            TypeError, r"nested more than 100 levels",
            hvd.MlfabricError, rf"rank\(s\) \[{bad}\] could not encode")


def _trip():
    os.environ[TRIPPED] = "1"
    return "ran"


class Tripwire:
    """Unpickling it runs _trip (as a hostile pickle would run anything)."""

    def __reduce__(self):
        return (_trip, ())


def case_plain_never_unpickles_what_a_pickling_sender_sent():
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        with pytest.raises(ValueError, match="serializer='json'"):
            hvd.allgather_object(1, serializer="json")
        return
    os.environ.pop(TRIPPED, None)
    # rank 0 pickles (the default); the others ask for plain data
    with pytest.raises(hvd.MlfabricError) as info:
        hvd.broadcast_object(Tripwire(), root_rank=0,
                             **({} if r == 0 else {"serializer": "plain"}))
    if r == 0:
        assert "could not unpickle" in str(info.value), info.value
    else:
        assert isinstance(info.value, hvd.MismatchError), info.value
        assert "not in the plain format" in str(info.value), info.value
    assert TRIPPED not in os.environ, "a plain receiver unpickled its peer's data"
    _still_in_step()
    # the other way round: plain data to a pickling receiver is a mismatch too
    with pytest.raises(hvd.MlfabricError) as info:
        hvd.broadcast_object([1], root_rank=0, **({"serializer": "plain"} if r == 0 else {}))
    if r:
        assert isinstance(info.value, hvd.MismatchError), info.value
    _still_in_step()
    # a serializer that does not exist, on one rank
    _expect(lambda: hvd.allgather_object(1, serializer="json"),
            lambda: hvd.allgather_object(1, serializer="plain"),
            ValueError, r"serializer='json': expected one of",
            hvd.MlfabricError, rf"rank\(s\) \[{n - 1}\] could not")
    _expect(lambda: hvd.broadcast_object(1, root_rank=0, serializer="json"),
            lambda: hvd.broadcast_object(1, root_rank=0, serializer="plain"),
            ValueError, r"serializer='json': expected one of",
            hvd.MlfabricError, rf"rank\(s\) \[{n - 1}\] could not")
