"""Policies and critics: the flow-matching action-chunk policy and its encoders."""

from robo_post.models.flow import FlowPolicy, FlowPolicyConfig, FlowPolicyRunner

__all__ = ["FlowPolicy", "FlowPolicyConfig", "FlowPolicyRunner"]
