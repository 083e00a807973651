"""What a completion scores: ARPO's reward functions for TRL and the answer parsing they share (`reward_functions`),
math equivalence with a bounded cost in worker processes (`math_scoring`; `_math_worker.py` is run by path), and
the scores and metrics of an evaluation run (`eval_metrics`, not re-exported here: it reads the rollout's records).

May import: tools, rollout, markdown.
"""

from arpo_trl.rewards.reward_functions import (
    FORMAT_CREDITS,
    GROUND_TRUTH_COLUMNS,
    MULTI_TOOL_BONUS,
    TOOL_TAGS,
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    choice_letter,
    choice_score,
    completion_own_text,
    completion_text,
    exact_match,
    extract_answer,
    f1_score,
    format_credit,
    format_credit_reward,
    formatted_answer,
    hierarchical_reward,
    is_choice,
    last_boxed,
    math_score,
    math_scores,
    normalize_answer,
    own_text,
    tiered,
    tools_used,
    validate_format,
)

__all__ = [
    "FORMAT_CREDITS", "GROUND_TRUTH_COLUMNS", "MULTI_TOOL_BONUS", "TOOL_TAGS", "answer_accuracy", "arpo_f1_reward",
    "arpo_math_reward", "choice_letter", "choice_score", "completion_own_text", "completion_text", "exact_match",
    "extract_answer", "f1_score", "format_credit", "format_credit_reward", "formatted_answer", "hierarchical_reward",
    "is_choice", "last_boxed", "math_score", "math_scores", "normalize_answer", "own_text", "tiered", "tools_used",
    "validate_format",
]
