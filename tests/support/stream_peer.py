"""A generator without an engine, for tests/unit/transport/test_transport_kill.py: a real process with a real
sample sender and a real rendezvous membership (heartbeats), producing deterministic samples.

    python tests/support/stream_peer.py RUN_DIR TRAINER_ADDRESS RANK [--stall-after N]

With ``--stall-after N`` it sends N samples, prints STALLED and hangs (heartbeating) until
killed: a generator that dies mid-stream still owing work, some of it possibly unacknowledged.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from streamrl_cli.rendezvous import RendezvousClient, read_secret  # noqa: E402
from streamrl_cli.transport.samples import StreamConfig, make_sender  # noqa: E402
from streamrl_cli.transport.wire import Sample  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("address")
    p.add_argument("rank", type=int)
    p.add_argument("--stall-after", type=int, default=-1)
    args = p.parse_args()
    rdv = RendezvousClient.from_run_dir(args.run_dir, timeout=5.0, retry_s=10.0)
    rdv.register("generator", args.rank)
    rdv.start_heartbeat()
    sender = make_sender(
        StreamConfig(max_delay_s=0.001),
        address=args.address,
        token=read_secret(args.run_dir),
        generator=rdv.member_id,
    )
    sender.wait_connected(30)
    print("READY", flush=True)
    sent = 0
    while True:
        for req in sender.requests(timeout=0.5):
            for i in req.sample_indices:
                if sent == args.stall_after:
                    print("STALLED", flush=True)
                    while True:
                        time.sleep(60)
                tokens = [len(req.prompt_id), i, *req.prompt_token_ids]
                now = time.time()
                sender.send(
                    Sample(
                        prompt_id=req.prompt_id,
                        sample_index=i,
                        group_id=req.group_id,
                        token_ids=tokens,
                        logprobs=[-0.25] * len(tokens),
                        finish_reason="stop",
                        weight_version=0,
                        queued_at=now,
                        first_token_at=now,
                        finished_at=now,
                    )
                )
                sent += 1
                time.sleep(0.01)


if __name__ == "__main__":
    main()
