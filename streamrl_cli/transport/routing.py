"""Which generator gets which prompt, and what happens to a lost generator's work.

Pure logic first: a :class:`DispatchPolicy` picks a generator for a request from the current
loads (outstanding samples per generator); :class:`Dispatcher` keeps the :class:`Ledger` under
a lock and turns every event (prompts submitted, generator joined, lost or restarted, sample
arrived) into assignments ``{generator: [Request, ...]}``. It is also the receiver's hooks:
``admit`` is where duplicates are dropped.

The wire path is :class:`DispatchService`, the trainer's one object for the stream: it owns
the receiver, sends the dispatcher's assignments through it, and follows the rendezvous
events so that a generator whose lease expired (``member_lost``) or that left has its
unacknowledged work re-dispatched to the others. The skewness-aware dispatcher of
docs/architecture.md (the paper's Algorithm 2, streamrl_cli.skew.dispatch_plan) places a whole batch at once,
so it does not fit a per-request policy: the trainer writes its choice into each request's
``target`` (and ``batch_limit``, ``priority``), which the dispatcher follows while that generator
is alive; a lost generator's work goes to the policy's choice like any other.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from streamrl_cli.transport import TransportError
from streamrl_cli.transport.ledger import Ledger, Outcome
from streamrl_cli.transport.samples import Assignments, StreamConfig, make_receiver
from streamrl_cli.transport.wire import Request, Sample

if TYPE_CHECKING:
    from streamrl_cli.rendezvous.client import RendezvousClient

log = logging.getLogger("streamrl.transport.dispatch")


class DispatchPolicy(ABC):
    """Chooses the generator for one request; sees only the alive generators' loads."""

    @abstractmethod
    def choose(self, request: Request, loads: Mapping[str, int]) -> str:
        """`loads`: alive generator -> outstanding samples, in the order the generators joined."""


class LeastLoaded(DispatchPolicy):
    """Round-robin by load: the generator owing the fewest samples; among equals, the next in turn."""

    def __init__(self) -> None:
        self._last = -1  # index (in join order) of the previous choice

    def choose(self, request: Request, loads: Mapping[str, int]) -> str:
        names = list(loads)
        low = min(loads.values())
        n = len(names)
        for step in range(1, n + 1):  # scan from the one after the previous choice: ties rotate
            i = (self._last + step) % n
            if loads[names[i]] == low:
                self._last = i
                return names[i]
        raise AssertionError("unreachable: some generator has the minimum load")


POLICIES: dict[str, type[DispatchPolicy]] = {"least_loaded": LeastLoaded}


def make_policy(name: str) -> DispatchPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise TransportError(
            f"unknown dispatch policy {name!r}; valid: {', '.join(sorted(POLICIES))}"
        ) from None


class Dispatcher:
    """The ledger and the policy behind one lock; every method returns the assignments to send."""

    def __init__(self, policy: DispatchPolicy | None = None):
        self.policy = policy or LeastLoaded()
        self.ledger = Ledger()
        self._alive: dict[str, None] = {}  # generators that may take work, in join order
        # Once the service follows the rendezvous: the generators registered there (alive). A
        # hello alone (any holder of the run's token can send one) then makes no generator.
        self._registered: set[str] | None = None
        self._hello: set[str] = set()  # said hello on the stream, registered or not (yet)
        self.unregistered_hellos = 0
        self._lock = threading.Lock()

    def require_registration(self, registered: Iterable[str]) -> Assignments:
        """From now on only generators registered in the rendezvous (and said hello) take work."""
        with self._lock:
            self._registered = set(registered)
            for g in [g for g in self._alive if g not in self._registered]:
                self._alive.pop(g)
                self.ledger.lose(g)
            for g in self._hello & self._registered:
                self._alive.setdefault(g)
            return self._assign_open()

    def registered(self, generator: str) -> Assignments:
        """The rendezvous knows `generator` (registered, revived): it takes work once it said hello."""
        with self._lock:
            if self._registered is not None:
                self._registered.add(generator)
            if generator in self._hello:
                self._alive.setdefault(generator)
            return self._assign_open()

    def restarted(self, generator: str) -> Assignments:
        """The rendezvous saw `generator` register again as a new process: the old one's work is
        lost, and the new one takes work once it says hello (the old hello does not count)."""
        with self._lock:
            self._alive.pop(generator, None)
            self._hello.discard(generator)
            if self._registered is not None:
                self._registered.add(generator)
            self.ledger.lose(generator)
            return self._assign_open()

    def working(self, generator: str) -> bool:
        """May take work now (the receiver keeps such peers when its table is full)."""
        with self._lock:
            return generator in self._alive or (
                self._registered is not None and generator in self._registered
            )

    def forget_generator(self, generator: str) -> None:
        """The receiver dropped this peer (it only said hello): forget that hello."""
        with self._lock:
            if generator not in self._alive:
                self._hello.discard(generator)

    def _may_work(self, generator: str) -> bool:
        return self._registered is None or generator in self._registered

    def submit(self, requests: Iterable[Request]) -> Assignments:
        """New prompts; assigned at once if any generator is alive, else when one joins."""
        with self._lock:
            for r in requests:
                self.ledger.add(r)
            return self._assign_open()

    def generator_joined(self, generator: str) -> Assignments:
        with self._lock:
            self._hello.add(generator)
            if not self._may_work(generator):
                self.unregistered_hellos += 1
                if self.unregistered_hellos % 100 == 1:  # a flood must not flood the log too
                    log.warning(
                        "%s said hello but is not a registered generator of this run; no work for it "
                        "(%d such hello(s) so far)",
                        generator,
                        self.unregistered_hellos,
                    )
                return {}
            self._alive.setdefault(generator)
            return self._assign_open()

    def lose(self, generator: str) -> Assignments:
        """`generator` is gone (lease expired, left): re-dispatch everything it had not delivered."""
        with self._lock:
            self._alive.pop(generator, None)
            if self._registered is not None:
                self._registered.discard(generator)
            lost = self.ledger.lose(generator)
            if lost:
                log.warning(
                    "%s lost with %d sample(s) undelivered; re-dispatching",
                    generator,
                    sum(len(r.sample_indices) for r in lost),
                )
            return self._assign_open()

    def generator_reset(self, generator: str) -> Assignments:
        """Same id, new process: its predecessor's work is lost, the newcomer can take work."""
        with self._lock:
            self.ledger.lose(generator)
            self._hello.add(generator)
            if self._may_work(generator):
                self._alive.setdefault(generator)
            return self._assign_open()

    def cancel(self, prompt_ids: Iterable[str], *, keep: bool = False) -> Assignments:
        """Stop wanting these prompts: each generator that still owes some of one gets a cancellation.
        `keep` (partial rollout's pause): the generators send back what they had, and those samples
        are still owed (a generator lost meanwhile has its share re-dispatched whole)."""
        out: dict[str, list[Request]] = {}
        with self._lock:
            for pid in prompt_ids:
                owers = self.ledger.owers(pid) if keep else self.ledger.cancel(pid)
                for g in sorted(owers):
                    cancel = Request(
                        prompt_id=pid, prompt_token_ids=[], sample_indices=[], cancel=True, keep=keep
                    )
                    out.setdefault(g, []).append(cancel)
        return out

    def admit(self, sample: Sample) -> bool:
        with self._lock:
            return self.ledger.complete(sample.prompt_id, sample.sample_index) is Outcome.NEW

    def outstanding(self) -> int:
        with self._lock:
            return len(self.ledger)

    def generators(self) -> list[str]:
        with self._lock:
            return list(self._alive)

    def _assign_open(self) -> dict[str, list[Request]]:
        out: dict[str, list[Request]] = {}
        if not self._alive:
            return out
        for r in self.ledger.open_requests():  # a whole prompt goes to one generator (prefix cache)
            if r.target in self._alive:  # placed by the trainer (skewness-aware dispatch)
                g = r.target
            else:  # no target, or its generator is gone: its work is the policy's to place
                g = self.policy.choose(r, {a: self.ledger.load(a) for a in self._alive})
            out.setdefault(g, []).append(self.ledger.assign(r.prompt_id, r.sample_indices, g))
        return out


class DispatchService:
    """The trainer's end of the stream: dispatcher + receiver + rendezvous watcher.

    Typical use (trainer rank 0)::

        svc = DispatchService(StreamConfig(bind="tcp://0.0.0.0:0"), token)
        rdv.register("trainer", 0, addresses={"samples": svc.address})
        svc.watch(rdv)                         # lost generators -> re-dispatch
        svc.submit(requests)                   # one Request per prompt, sample_indices 0..n-1
        while svc.outstanding():
            sample = svc.get(timeout=1.0)      # each (prompt_id, sample_index) exactly once
    """

    def __init__(self, config: StreamConfig, token: str, *, policy: DispatchPolicy | None = None):
        self.dispatcher = Dispatcher(policy)
        self.receiver = make_receiver(config, token=token, hooks=self.dispatcher)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.receiver.address  # type: ignore[attr-defined]

    def submit(self, requests: Iterable[Request]) -> None:
        self._send(self.dispatcher.submit(requests))

    def cancel(self, prompt_ids: Iterable[str], *, keep: bool = False) -> None:
        """No more samples of these prompts are wanted: generators drop them, late copies are dropped.
        `keep`: generators send back each sample as far as it got (partial rollout pauses them)."""
        self._send(self.dispatcher.cancel(prompt_ids, keep=keep))

    def lost(self, generator: str) -> None:
        """Call when the rendezvous reports `generator` lost or gone (watch() does it for you)."""
        self._send(self.dispatcher.lose(generator))

    def revived(self, generator: str) -> None:
        # Only one whose stream is connected takes work again. A generator that was lost before its
        # hello (its heartbeats starved while its engine started, a late joiner still waiting for
        # weights), or whose stream is gone, takes work once it says hello (again): its old hello
        # no longer counts.
        connected = getattr(self.receiver, "generators", None)
        if connected is not None and generator not in connected():
            self.dispatcher.forget_generator(generator)
        self._send(self.dispatcher.registered(generator))

    def get(self, timeout: float | None = None) -> Sample | None:
        return self.receiver.get(timeout)

    def outstanding(self) -> int:
        """Samples submitted and not yet received."""
        return self.dispatcher.outstanding()

    def generators(self) -> list[str]:
        """The generators work can go to now (alive, in the order they joined)."""
        return self.dispatcher.generators()

    def watch(self, rdv: RendezvousClient, role: str = "generator", since: int | None = None) -> None:
        """Follow the rendezvous events in a daemon thread: lost/left members of `role` are re-dispatched."""
        start = rdv.versions()["event_seq"] if since is None else since
        # Registered members first (events from `start` on keep it current): dispatch goes only
        # to generators the rendezvous knows, never to a peer that merely said hello.
        self._send(
            self.dispatcher.require_registration(
                m["member_id"] for m in rdv.members(role) if m["state"] == "alive"
            )
        )
        self._watcher = threading.Thread(
            target=self._watch, args=(rdv, f"{role}-", start), name="dispatch-watch", daemon=True
        )
        self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        self.receiver.close()
        if self._watcher is not None:
            self._watcher.join(timeout=2)

    def _send(self, assignments: Assignments) -> None:
        for g, reqs in assignments.items():
            self.receiver.dispatch(g, reqs)

    def _watch(self, rdv: RendezvousClient, prefix: str, since: int) -> None:
        while not self._stop.is_set():
            try:
                doc = rdv.events(since, timeout=1.0)
            except Exception as e:  # the server restarting: the client already retried for retry_s
                log.warning("dispatch watcher: rendezvous events failed: %s", e)
                self._stop.wait(1.0)
                continue
            since = doc["next_since"]
            if doc.get("resync"):
                self._resync(rdv, prefix)
            for ev in doc["events"]:
                self.on_event(ev, prefix)

    def on_event(self, event: Mapping[str, Any], prefix: str = "generator-") -> None:
        member = event.get("data", {}).get("member_id", "")
        if not member.startswith(prefix):
            return
        if event["type"] in ("member_lost", "member_left"):
            self.lost(member)
        elif event["type"] == "member_revived":
            self.revived(member)
        elif event["type"] == "member_registered":
            if event["data"].get("incarnation", 1) > 1:
                # A new process under the same id (restarted within a lease, so never lost): its
                # predecessor's work died with it; the newcomer takes work once it says hello.
                self._send(self.dispatcher.restarted(member))
            else:
                self.revived(member)

    def _resync(self, rdv: RendezvousClient, prefix: str) -> None:
        for m in rdv.members():
            if m["member_id"].startswith(prefix) and m["state"] in ("lost", "left"):
                self.lost(m["member_id"])
