#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh venv (no checkout on the path) and runs the
# main commands from there: --version, a 2-episode collect, a 10-update train, an eval and a
# Minari and a LeRobot round trip. Catches packages or data files missing from the wheel, which an
# editable install hides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export MUJOCO_GL=${MUJOCO_GL:-egl} MINARI_DATASETS_PATH="$WORK/minari"

$PY -m pip wheel -q --no-deps -w "$WORK/dist" .
rm -rf build  # setuptools builds in the checkout
$PY -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --upgrade pip==25.3
"$WORK/venv/bin/pip" install -q -c constraints.txt "$WORK"/dist/robo_post-*.whl
RP="$WORK/venv/bin/robo-post"

cd "$WORK"   # nothing of the checkout importable from here
"$WORK/venv/bin/python" - <<'PY'
import robo_post, robo_post.algos.registry, robo_post.steering.poe, robo_post.envs.registry, robo_post.fleet.collect
assert "site-packages" in robo_post.__file__, robo_post.__file__
for pkg in ("gym", "d3rlpy"):  # benchmark-only peers stay out of the default install
    try:
        __import__(pkg)
    except ImportError:
        continue
    raise SystemExit(f"the default install pulled {pkg}")
PY
"$RP" --version
"$RP" collect env=point_mass policy=expert episodes=2 store=s show=false
"$RP" train store=s algo=bc_flow updates=10 run_dir=r show=false
"$RP" eval store=s 'version=[1]' episodes_per_task=2 show=false
"$RP" store export-minari s smoke/point-mass-v0
"$RP" store import-minari smoke/point-mass-v0 s2 --success-from truncation
"$RP" store validate s2
"$RP" store export-lerobot s lerobot
"$RP" store import-lerobot lerobot s3 --success-from truncation
"$RP" store validate s3
echo "wheel smoke test passed"
