"""Evaluation: pinned-version rollouts with Wilson confidence intervals, and reports."""

from robo_post.eval.report import write_report
from robo_post.eval.rollout import EVAL_SEED, evaluate, load_results, policy_label, wilson_interval

__all__ = ["EVAL_SEED", "evaluate", "load_results", "policy_label", "wilson_interval", "write_report"]
