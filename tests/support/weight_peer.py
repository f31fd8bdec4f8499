"""A generator without an engine, for tests/unit/weights/test_weights_elastic.py: a real process with a real
rendezvous membership that follows the elastic weight protocol (``weights.layout``) on a real gloo
group, and prints what it received.

    python tests/support/weight_peer.py RUN_DIR RANK [--die-when-ready VERSION]

Prints ``GOT <version> <digest>`` per loaded version (digest: sum of every received value) and
``FAILED <version>`` per failed transfer. With ``--die-when-ready V`` it says it is ready for
version V and exits at once: a member lost between the readiness handshake and the broadcast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from streamrl_cli.rendezvous import RendezvousClient  # noqa: E402
from streamrl_cli.weights.broadcast import init_weight_group, receive_weights  # noqa: E402
from streamrl_cli.weights.layout import GroupLayout, receiving_state  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("rank", type=int)
    p.add_argument("--die-when-ready", type=int, default=-1)
    args = p.parse_args()
    rdv = RendezvousClient.from_run_dir(args.run_dir, timeout=5.0, retry_s=10.0)
    rdv.register("generator", args.rank, info={"workers": 1})
    since = rdv.versions()["event_seq"]  # proposals from here on are ours
    rdv.set_status(state="generating")
    rdv.start_heartbeat()
    rdv.heartbeat()  # past start-up: the trainer may include us from now on
    group, joined = None, None
    while True:
        doc = rdv.events(since, timeout=5.0)
        since = doc["next_since"]
        for ev in doc["events"]:
            data = ev["data"]
            if ev["type"] == "member_left" and data["member_id"] == "trainer-0":
                return
            layout = GroupLayout.from_proposal(data) if ev["type"] == "version_proposed" else None
            place = layout.source(rdv.member_id, rdv.incarnation) if layout else None
            if place is None:
                continue
            version = data["version"]
            rdv.set_status(state=receiving_state(version, layout.group))
            rdv.heartbeat()
            if version == args.die_when_ready:
                os._exit(9)
            try:
                if joined != layout.group:
                    if group is not None:
                        group.close()
                    group, joined = None, None
                    group = init_weight_group(
                        layout.address, place["first_rank"], layout.world_size, timeout_s=layout.timeout_s
                    )
                    joined = layout.group
                sent, tensors = receive_weights(group)
            except Exception as e:  # noqa: BLE001 - the trainer sends it again on a new group
                print(f"FAILED {version} {type(e).__name__}", flush=True)
                group, joined = None, None
                rdv.set_status(state="generating")
                continue
            digest = sum(float(t.double().sum()) for t in tensors.values())
            print(f"GOT {sent} {digest:.6f}", flush=True)
            rdv.set_status(state="generating", weight_version=sent)
            rdv.confirm_version(sent)


if __name__ == "__main__":
    main()
