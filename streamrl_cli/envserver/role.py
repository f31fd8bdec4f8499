"""The environment server role (``roles.env_server``): one :class:`~.server.EnvServer` per instance.

It registers as member ``env_server-<rank>`` with its address (``addresses.env``), heartbeats,
posts its calls and failures as metrics (``streamrl status``), and leaves when the trainer leaves
for good (the run is over), when the trainer stays away past ``train.stall_after_s`` (an error),
on SIGTERM (``streamrl cancel``), or on SLURM's time-limit warning (its task requeues itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from streamrl_cli.envserver.server import ADDRESS, ROLE, EnvServer, settings_of
from streamrl_cli.errors import StreamRLError
from streamrl_cli.roles.requeue import requeue_leave_reason
from streamrl_cli.roles.serving import serve_until_stopped
from streamrl_cli.roles.spec import EnvServerSpec

log = logging.getLogger("streamrl.env_server")

METRICS_S = 5.0
WAIT_S = 600.0  # for the rendezvous file


def main(spec: EnvServerSpec, rank: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(EnvServerRole(spec, rank).run())


class EnvServerRole:
    """One environment server instance: the server, its rendezvous membership, its end."""

    def __init__(self, spec: EnvServerSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.member_id = f"{ROLE}-{rank}"
        self.server: EnvServer | None = None
        self.rdv: Any = None
        self._stop = asyncio.Event()
        self._requeue = False

    async def run(self) -> int:
        from streamrl_cli.rendezvous import read_secret
        from streamrl_cli.rendezvous.client import RendezvousClient
        from streamrl_cli.roles.preflight import wait_for_file
        from streamrl_cli.roles.requeue import under_slurm

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if under_slurm():  # SLURM's time-limit warning: leave, and come back in the requeued task
            loop.add_signal_handler(signal.SIGUSR2, self._requeue_requested)
        run_dir = Path(self.spec.run_dir)
        await asyncio.to_thread(wait_for_file, Path(self.spec.rendezvous_file), WAIT_S)
        self.rdv = RendezvousClient.from_run_dir(run_dir, tls_ca=self.spec.rendezvous_ca)
        failure: BaseException | None = None
        try:
            self.server = EnvServer(
                settings_of(self.spec), read_secret(run_dir), client_silent_s=self.spec.train.stall_after_s
            )
            port = await self.server.start()
            host = socket.gethostname()
            workers = self.server.host.settings.workers
            env = self.spec.agent.env or "tools only"
            self.rdv.register(
                ROLE, self.rank, cluster=self.spec.cluster, site=self.spec.site, host=host,
                addresses={ADDRESS: f"{host}:{port}"},
                info={"program": ROLE, "env": env, "workers": workers, "pid": os.getpid()},
            )  # fmt: skip
            self.rdv.set_status(state="serving")
            self.rdv.start_heartbeat()
            log.info(
                "%s serving %s on %s:%d (%d environment processes)", self.member_id, env, host, port, workers
            )
            await self._serve()
            return 0
        except BaseException as e:
            failure = e
            raise
        finally:
            await self._shutdown(failure)

    def _requeue_requested(self) -> None:
        log.warning("%s: SIGUSR2: leaving; the task requeues itself", self.member_id)
        self._requeue = True
        self._stop.set()

    async def _serve(self) -> None:
        assert self.server is not None
        await serve_until_stopped(
            {"serve": self.server.serve(), "trainer": self._follow_trainer(), "metrics": self._report()},
            self._stop,
        )

    async def _follow_trainer(self) -> None:
        """Return once the run is over: the trainer left for good (not to come back: a requeue, a
        restart), or went and stayed away past train.stall_after_s (an error)."""
        from streamrl_cli.roles.requeue import PREEMPTED, REQUEUED
        from streamrl_cli.roles.restart import RESTARTING

        since, gone_since = 0, None
        while True:
            doc = await asyncio.to_thread(self.rdv.events, since, 10.0)
            since = doc["next_since"]
            for ev in doc["events"]:
                data = ev.get("data", {})
                if data.get("member_id") != "trainer-0":
                    continue
                if ev["type"] == "member_left":
                    reason = str(data.get("reason") or "")
                    if not reason.startswith((REQUEUED, PREEMPTED, RESTARTING)):
                        log.info("%s: the trainer left (%s); finishing", self.member_id, reason or "stopped")
                        return
                    gone_since = gone_since or time.monotonic()
                elif ev["type"] == "member_lost":
                    gone_since = gone_since or time.monotonic()
                elif ev["type"] == "member_registered":
                    gone_since = None
            wait_s = self.spec.train.stall_after_s
            if gone_since is not None and time.monotonic() - gone_since > wait_s:
                raise StreamRLError(
                    f"the trainer went and did not come back within train.stall_after_s={wait_s:.0f}s"
                )

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(METRICS_S)
            try:
                await asyncio.to_thread(self.rdv.post_metrics, self.server.metrics())  # type: ignore[union-attr]
            except StreamRLError as e:  # metrics are not worth dying for
                log.warning("%s: metrics not posted: %s", self.member_id, e)

    async def _shutdown(self, failure: BaseException | None) -> None:
        if self.rdv is not None and self.rdv.member_id is not None:
            if self._requeue and failure is None:
                reason = requeue_leave_reason(self.member_id)
            elif failure is None or isinstance(failure, asyncio.CancelledError):
                reason = "stopped"
            else:
                reason = f"failed: {type(failure).__name__}: {failure}"
                log.error("%s: %s", self.member_id, reason)
            try:
                if self.server is not None:  # the last counts stay visible after we left
                    self.rdv.post_metrics(self.server.metrics())
                self.rdv.leave(reason)
            except StreamRLError as e:
                log.warning("%s: could not leave the rendezvous: %s", self.member_id, e)
        if self.rdv is not None:
            self.rdv.close()
        if self.server is not None:
            await self.server.close()
