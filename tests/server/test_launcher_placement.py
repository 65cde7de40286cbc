"""Where `pdserve serve` puts its workers, router and front on the cores it may use
(pdserve/server/launcher.py); the processes themselves are checked end to end in
tests/server/test_settings_e2e.py."""

from argparse import Namespace

from pdserve.server.launcher import _placement, _relay_cores


def _args(prefill=1, decode=1, threads=None, pin=True):
    return Namespace(prefill=prefill, decode=decode, threads=threads, pin=pin)


def test_two_cores_one_each_and_the_router_with_decode():
    placement = _placement(_args(), cores=[0, 1])
    assert placement == [("prefill", [0]), ("decode", [1])]
    assert _relay_cores(placement, cores=[0, 1]) == [1]


def test_the_cores_are_shared_out_and_a_spare_one_takes_the_router():
    cores = list(range(8))
    placement = _placement(_args(prefill=2, decode=1), cores=cores)
    assert placement == [("prefill", [0, 1]), ("prefill", [2, 3]), ("decode", [4, 5])]
    assert _relay_cores(placement, cores=cores) == [6, 7]  # left over: neither pool's
    placement = _placement(_args(), cores=[0, 1, 2])
    assert placement == [("prefill", [0]), ("decode", [1])]
    assert _relay_cores(placement, cores=[0, 1, 2]) == [2]


def test_several_decode_workers_share_the_router():
    placement = _placement(_args(prefill=1, decode=3), cores=[0, 1, 2, 3])
    assert _relay_cores(placement, cores=[0, 1, 2, 3]) == [1, 2, 3]


def test_unpinned_leaves_everything_to_the_os():
    for args, cores in ((_args(pin=False), [0, 1]), (_args(prefill=2, decode=2), [0, 1]), (_args(threads=2), [0, 1])):
        placement = _placement(args, cores=cores)
        assert all(cs is None for _, cs in placement), (args, placement)
        assert _relay_cores(placement, cores=cores) is None
