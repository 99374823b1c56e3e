"""Hydra configs shipped with robo-post (data package)."""
