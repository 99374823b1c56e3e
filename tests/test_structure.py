"""Package layout: the layers point one way and no imports form a cycle, as the
import-linter contracts in pyproject.toml (``[tool.importlinter]``) state them.

import-linter reads imports from the source, module level and inside functions alike (a
lazy import hides a cycle from Python, not from the design); annotations-only imports
never run and are left out. robo_post.envs and robo_post.fleet install from envs/ and
fleet/ (setup.py), a mapping import-linter cannot follow, so it lints a copy of the
layout as installed.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")  # the venv's


def _installed_layout() -> dict[str, str]:
    """Package -> source folder, as setup.py installs them: robo_post/, and each of its
    TOP_LEVEL folders under robo_post's namespace."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    top_level = next(ast.literal_eval(node.value) for node in tree.body
                     if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TOP_LEVEL")
    return {"robo_post": "robo_post", **{f"robo_post.{folder}": folder for folder in top_level}}


def _stage(dest: os.PathLike) -> str:
    """The Python files of every installed package, copied under ``dest`` where they install."""
    def code_only(folder: str, names: list[str]) -> list[str]:
        return [n for n in names
                if n == "__pycache__" or not (n.endswith(".py") or os.path.isdir(os.path.join(folder, n)))]

    for package, folder in _installed_layout().items():
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dest, *package.split(".")), ignore=code_only,
                        dirs_exist_ok=True)
    return str(dest)


def _lint(staged: str, *contracts: str) -> subprocess.CompletedProcess:
    """The contracts (default: all) checked on ``staged``: lint-imports imports robo_post from
    its working directory, ahead of the editable install."""
    args = [LINT_IMPORTS, PYPROJECT, "--no-cache", "--no-logo", *(f"--contract={c}" for c in contracts)]
    return subprocess.run(args, cwd=staged, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})  # no wrapped lines to match against


@pytest.mark.slow
def test_import_contracts_are_kept(tmp_path):
    with open(PYPROJECT, "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    result = _lint(_stage(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(contracts)} kept, 0 broken." in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("contract, module, planted, broken", [
    # the two package cycles the layers removed, back
    ("layers", "robo_post/models/gaussian.py", "from robo_post.steering.poe import compose",
     "robo_post.models is not allowed to import robo_post.steering"),
    ("layers", "robo_post/fleet/collect.py", "from robo_post.eval.rollout import evaluate",
     "robo_post.fleet is not allowed to import robo_post.eval"),
    ("layers", "robo_post/eval/report.py", "def planted():\n    from robo_post.learner.loop import train_loop",
     "robo_post.eval is not allowed to import robo_post.learner"),  # a lazy import counts
    ("layers", "robo_post/unlisted/__init__.py", "", "- robo_post.unlisted"),  # a package in no layer
    ("acyclic", "robo_post/store/schema.py", "import robo_post.store.writer",
     "No cycles are allowed in robo_post.store."),
    ("benchmark-peers", "robo_post/algos/sb3_agent.py", "import gym", "robo_post.algos.sb3_agent -> gym"),
    ("extras", "robo_post/fleet/collect.py", "import ray", "robo_post.fleet.collect -> ray"),
])
def test_a_planted_import_breaks_its_contract(tmp_path, contract, module, planted, broken):
    staged = _stage(tmp_path)
    path = os.path.join(staged, module)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(f"\n{planted}\n")
    result = _lint(staged, contract)
    assert result.returncode == 1 and broken in result.stdout, result.stdout + result.stderr
    assert "Contracts: 0 kept, 1 broken." in result.stdout
