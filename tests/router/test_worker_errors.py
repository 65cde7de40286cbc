"""How the router names a worker it could not reach, and whether it calls it dead."""

import types

import httpx

from pdserve.router.disagg import WorkerGone, WorkerSlow, _unreachable

W = types.SimpleNamespace(worker_id="prefill-0")


def test_a_timeout_is_slow_not_dead_and_the_message_is_never_empty():
    slow = _unreachable(W, httpx.ConnectTimeout(""))
    assert isinstance(slow, WorkerSlow) and str(slow) == "prefill-0: ConnectTimeout"
    gone = _unreachable(W, httpx.ConnectError("[Errno 111] Connection refused"))
    assert type(gone) is WorkerGone and str(gone) == "prefill-0: ConnectError: [Errno 111] Connection refused"
