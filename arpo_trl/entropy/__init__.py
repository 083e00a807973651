"""What ARPO measures as entropy: per-token estimators (`estimators`), the segment statistic the fork rule compares,
and, for the transformers backend, the recorder of each step's entropy and of the sampled token's logprob under the
distribution actually sampled (`recorder`).

May import: nothing outside entropy.
"""

from arpo_trl.entropy.estimators import (
    DEFAULT_SERVER_TOP_K,
    ENTROPY_ESTIMATORS,
    SEGMENT_STATISTICS,
    check_entropy_args,
    resolve_estimator,
    segment_entropy,
    token_entropy,
    top_k_entropies,
)
from arpo_trl.entropy.recorder import SampledDistributionRecorder, sampling_warpers

__all__ = [
    "DEFAULT_SERVER_TOP_K", "ENTROPY_ESTIMATORS", "SEGMENT_STATISTICS", "SampledDistributionRecorder",
    "check_entropy_args", "resolve_estimator", "sampling_warpers", "segment_entropy", "token_entropy",
    "top_k_entropies",
]
