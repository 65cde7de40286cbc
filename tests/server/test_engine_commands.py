"""The loop's side of the engine thread: request ids and the named engine commands."""
import asyncio

from pdserve.engine.sequence import choice_request_id
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.metrics import ServerMetrics


def test_choice_request_ids_are_the_request_id_and_the_index():
    assert choice_request_id("req-7", 2) == "req-7-2"
    # a worker's routes carry the router's choice id; their one engine request is index 0
    assert choice_request_id(choice_request_id("cmpl-x", 1)) == "cmpl-x-1-0"


def test_a_group_attached_by_a_worker_route_uses_the_id_its_kv_is_keyed_by():
    """The decode route keys the KV receiver by choice_request_id(request_id) and attaches
    a group for request_id: the group's engine request must be that same id."""
    async def main():
        engine = AsyncEngine(lambda: None, ServerMetrics)
        engine.metrics = ServerMetrics("m")
        return engine.attach("cmpl-x-1", 1).subs[0].rid
    assert asyncio.run(main()) == choice_request_id("cmpl-x-1")
