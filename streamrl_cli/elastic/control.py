"""The trainer's side of the elastic rule: measure each iteration, decide, ask the rendezvous.

The trainer decides because it is where T_gen and T_train are measured; it does not start or stop
anything itself (it may run on a node that cannot submit jobs): it posts the wanted instance count
to the rendezvous, and the process watching the run applies it (``launch.scale.follow``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from streamrl_cli.elastic.policy import HOLD, ElasticPolicy, Observation

if TYPE_CHECKING:
    from streamrl_cli.recipe.schema import ElasticConfig

log = logging.getLogger("streamrl.elastic")


class ElasticController:
    def __init__(self, config: ElasticConfig, rdv: Any, instances: Any):
        """`instances()`: the generator instances serving now (the dispatcher's alive generators)."""
        self.policy = ElasticPolicy(config=config)
        self.rdv, self.instances = rdv, instances

    def after_iteration(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Decide from iteration record `rec`; returns the `elastic/*` metrics to add to it."""
        n = int(self.instances())
        d = self.policy.observe(
            Observation(
                iteration=int(rec["iteration"]), instances=n, t_gen=float(rec["t/generation"]),
                t_train=float(rec["t/train"]), generator_idle=float(rec["idle/generator"]),
                t_floor=float(rec.get("t/longest_sample", 0.0)),
            )
        )  # fmt: skip
        out = {
            "elastic/instances": n,
            "elastic/target": d.target,
            "elastic/delta": d.delta,
            "elastic/delta_prime": d.delta_prime,
        }
        if d.action != HOLD:
            log.info("elastic: %s -> %d instance(s): %s", d.action, d.target, d.reason)
            try:
                self.rdv.request_scale(d.target, source="policy", reason=f"{d.action}: {d.reason}")
            except Exception as e:  # a lost request costs one decision, never the run
                log.warning("elastic: could not post the scale request: %s", e)
        return out
