"""robo-post: post-training stack for robot and driving policies."""

import sys

__version__ = "0.1.0"

# Stable-Baselines3 probes for the old `gym` package, which d3rlpy (a benchmark peer) installs;
# gym 0.26 then prints a four-line deprecation banner to stderr, ahead of every message of a
# command that loads SB3. gym prints it only if its `gym_notices` lookup imports.
sys.modules.setdefault("gym_notices", None)  # type: ignore[arg-type]
