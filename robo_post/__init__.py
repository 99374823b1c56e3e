"""robo-post: post-training stack for robot and driving policies."""

__version__ = "0.1.0"
