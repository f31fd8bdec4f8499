"""A generator lost and revived before its stream connected takes no work until its hello.

Seen in a real scale-up: a new instance's heartbeats starved while its engine started (the lease
ran out), it came back, and the trainer's dispatcher counted it as ready; the next batch was split
onto it while it still waited for weights, which come only after that batch: the run stalled.
"""

from __future__ import annotations

import time

from streamrl_cli.transport.routing import DispatchService
from streamrl_cli.transport.samples import StreamConfig, make_sender
from streamrl_cli.transport.wire import Request


def test_revived_before_hello_is_not_dispatched_to_until_it_connects():
    token = "t" * 32
    svc = DispatchService(StreamConfig(bind="tcp://127.0.0.1:0"), token)
    sender = None
    try:
        svc.on_event({"type": "member_lost", "data": {"member_id": "generator-1"}})
        svc.on_event({"type": "member_revived", "data": {"member_id": "generator-1"}})
        assert svc.generators() == []
        svc.submit([Request(prompt_id="it0/p0", prompt_token_ids=[1], sample_indices=[0])])
        assert svc.dispatcher.ledger.load("generator-1") == 0  # nothing assigned to it
        # Its hello makes it a generator that takes work, and the open prompt goes to it.
        sender = make_sender(StreamConfig(), address=svc.address, token=token, generator="generator-1")
        sender.wait_connected(20.0)
        deadline = time.monotonic() + 20
        while not (reqs := sender.requests(0.2)):
            assert time.monotonic() < deadline, "the open prompt never reached the generator"
        assert [r.prompt_id for r in reqs] == ["it0/p0"]
        assert svc.generators() == ["generator-1"]
    finally:
        if sender is not None:
            sender.close(1.0)
        svc.close()
