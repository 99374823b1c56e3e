"""Evaluation on any env: pinned-version rollouts with 95% intervals (Wilson for rates,
Student t for means), and reports."""

from robo_post.eval.report import write_report
from robo_post.eval.rollout import EVAL_SEED, evaluate, load_results, mean_interval, policy_label, wilson_interval

__all__ = [
    "EVAL_SEED", "evaluate", "load_results", "mean_interval", "policy_label", "wilson_interval", "write_report",
]
