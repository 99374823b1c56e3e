"""Package discovery (metadata lives in pyproject.toml).

Every package under ``robo_post/`` is found, not listed. The top-level folders below
sit beside ``robo_post/`` in the checkout but install under its namespace
(``robo_post.envs``, ...), so nothing generic lands in site-packages.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ("envs", "fleet", "configs", "sim_assets")

packages = find_packages(include=["robo_post", "robo_post.*"])
package_dir = {"robo_post": "robo_post"}
for folder in TOP_LEVEL:
    for sub in [""] + [f".{p}" for p in find_packages(where=folder)]:
        packages.append(f"robo_post.{folder}{sub}")
    package_dir[f"robo_post.{folder}"] = folder

setup(packages=packages, package_dir=package_dir)
