"""The RL maths by concern: pure torch, no I/O, no state, no trainer.

One registry per kind of choice, each entry one public function with the kind's signature:

====================  ======================================  ==================================
registry              recipe key                              module
====================  ======================================  ==================================
``ADVANTAGES``        ``algorithm.advantage``                 :mod:`.advantages`
``POLICY_LOSSES``     ``algorithm.policy_loss``               :mod:`.policy_losses`
``CORRECTIONS``       ``algorithm.is_level``, ``is_mask``     :mod:`.corrections`
``KL_ESTIMATORS``     ``algorithm.kl_estimator``              :mod:`.kl`
====================  ======================================  ==================================

`algorithm.name` is a preset (``recipe.presets``) of these names and a few coefficients, resolved
once by the recipe's checks. A new algorithm is one module whose functions register themselves
(``@POLICY_LOSSES.register("mine")``), imported below, plus one preset naming them (and the new
names in the schema's choices, which the recipe checks against). What is not a choice (GAE,
aggregation, log-probs under the sampling distribution) is ``trainer.algo.losses``.
"""

from streamrl_cli.trainer.algo.advantages import (
    ADVANTAGES,
    Estimator,
    batch_whiten,
    distilled_advantages,
    estimator,
    grpo_advantages,
    informative,
    overlong_penalty,
    rloo_advantages,
)
from streamrl_cli.trainer.algo.corrections import CORRECTIONS, is_weights, keep_mask
from streamrl_cli.trainer.algo.kl import KL_ESTIMATORS, kl_estimate
from streamrl_cli.trainer.algo.policy_losses import POLICY_LOSSES, PolicyLoss, clip_loss, policy_loss
from streamrl_cli.trainer.algo.registry import Registry
from streamrl_cli.trainer.algo.tensors import LOG_RATIO_BOUND, per_token

__all__ = [
    "ADVANTAGES", "CORRECTIONS", "KL_ESTIMATORS", "LOG_RATIO_BOUND", "POLICY_LOSSES", "Estimator",
    "PolicyLoss", "Registry", "batch_whiten", "clip_loss", "distilled_advantages", "estimator",
    "grpo_advantages", "informative", "is_weights", "keep_mask", "kl_estimate", "overlong_penalty",
    "per_token", "policy_loss", "rloo_advantages",
]  # fmt: skip
