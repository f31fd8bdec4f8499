"""Output-length rankers for skewness-aware generation ("rankability over predictability";
docs/architecture.md).

:func:`make_ranker` builds the one a recipe's ``skewness`` section names; :func:`quality` measures
one. Torch and transformers are imported only by the learned ranker, when it is made.
"""

from streamrl_cli.ranker.base import KINDS, OracleRanker, RandomRanker, Ranker, RankerError
from streamrl_cli.ranker.factory import make_ranker
from streamrl_cli.ranker.quality import QualityTracker, quality

__all__ = [
    "KINDS",
    "OracleRanker",
    "QualityTracker",
    "RandomRanker",
    "Ranker",
    "RankerError",
    "make_ranker",
    "quality",
]
