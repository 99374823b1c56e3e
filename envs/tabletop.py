"""Language-conditioned tabletop manipulation in MuJoCo.

A position-controlled two-finger gripper works over a table with three coloured
blocks (red, green, blue) and three flat target zones (yellow, purple, white).
Every episode samples a layout and the objects named by the instruction from the
reset seed. Tasks:

- ``reach``: move the gripper onto a zone.
- ``push``: push a block into a zone without lifting it: a block whose centre ever
  rises above ``PUSH_MAX_HEIGHT`` was carried, and the episode cannot succeed.
- ``pick``: grasp a block and lift it above ``LIFT_HEIGHT``.
- ``place``: put a block down inside a zone and let go of it.
- ``sort``: long-horizon; place block A in zone X, then block B in zone Y.
  ``info["progress"]`` is the fraction of stages done, in order.

The reward is sparse: 1.0 on the step that reaches success (which also terminates
the episode), else 0.0.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

if sys.platform.startswith("linux"):
    # Headless Linux has no display for GLFW; EGL renders offscreen. Must precede `import mujoco`.
    os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium import spaces

Split = Literal["train", "heldout", "all"]

TASKS: tuple[str, ...] = ("reach", "push", "pick", "place", "sort")
BLOCKS: tuple[str, ...] = ("red", "green", "blue")
ZONES: tuple[str, ...] = ("yellow", "purple", "white")

BLOCK_HALF = 0.02  # half edge of a block cube (m)
ZONE_RADIUS = 0.05  # drawn radius of a target zone (m)
SUCCESS_RADIUS = 0.04  # a block centre this close to a zone centre is "in" the zone
REACH_RADIUS = 0.03  # horizontal tolerance of the reach task
REACH_HEIGHT = 0.06  # the gripper must be below this height over the zone
LIFT_HEIGHT = 0.10  # block centre height that counts as picked
RESTING_HEIGHT = BLOCK_HALF + 0.01  # a block below this is on the table, not held
PUSH_MAX_HEIGHT = BLOCK_HALF + 0.03  # pushed blocks bump up <= 1.6 cm; carried ones rise > 4 cm
RELEASED_GAP = 2 * BLOCK_HALF + 0.015  # finger gap above which a block is not squeezed
FINGER_OPEN = 0.045  # travel of each finger from the centre line (m)

MAX_DELTA = 0.025  # end-effector displacement per control step at |action| = 1 (m)
MAX_LEAD = 0.05  # how far the position target may run ahead of the gripper; avoids wind-up
N_SUBSTEPS = 20  # physics steps per control step
CONTROL_DT = N_SUBSTEPS * 0.002  # seconds per control step (the MJCF timestep is 2 ms): 25 Hz
WORKSPACE_LOW = np.array([-0.28, -0.28, 0.015])
WORKSPACE_HIGH = np.array([0.28, 0.28, 0.30])
LAYOUT_HALF_EXTENT = 0.18  # blocks and zones are sampled in [-e, e]^2

DEFAULT_MAX_STEPS: dict[str, int] = {"reach": 40, "push": 60, "pick": 60, "place": 80, "sort": 160}

# Layout of obs["proprio"]: (name, size) in order. Positions are world metres.
PROPRIO_FIELDS: tuple[tuple[str, int], ...] = (
    ("ee_pos", 3),
    ("gripper_gap", 1),
    ("block_pos", 3 * len(BLOCKS)),  # xyz per block, in BLOCKS order
    ("zone_xy", 2 * len(ZONES)),  # xy per zone, in ZONES order
    ("target_block", len(BLOCKS)),  # one-hot of the current stage's block (zeros for reach)
    ("target_zone", len(ZONES)),  # one-hot of the current stage's zone (zeros for pick)
    ("progress", 1),  # fraction of stages done
    # The current stage's goal relative to the gripper (zeros where the stage has none):
    # the same facts as the one-hots, in the frame a reactive policy acts in.
    ("block_rel", 3),  # target block xyz - gripper xyz
    ("zone_rel", 2),  # target zone xy - target block xy (or - gripper xy when no block)
)
PROPRIO_DIM = sum(size for _, size in PROPRIO_FIELDS)

# Instruction templates per task: (train, heldout). Held-out phrasings are only
# used for evaluation, so a policy must generalise across wording.
_TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "reach": (
        (
            "move the gripper to the {zone} zone",
            "reach the {zone} target",
            "go to the {zone} zone",
            "put the gripper over the {zone} circle",
        ),
        (
            "hover just above the {zone} area",
            "bring the end effector to the {zone} marker",
        ),
    ),
    "push": (
        (
            "push the {block} block into the {zone} zone",
            "slide the {block} block to the {zone} target",
            "shove the {block} cube onto the {zone} zone",
            "nudge the {block} block over to the {zone} circle",
        ),
        (
            "without lifting it, move the {block} cube into the {zone} area",
            "drive the {block} block along the table to the {zone} marker",
        ),
    ),
    "pick": (
        (
            "pick up the {block} block",
            "lift the {block} block",
            "grab the {block} cube and raise it",
            "pick the {block} block off the table",
        ),
        (
            "raise the {block} cube into the air",
            "grasp the {block} block and hold it up high",
        ),
    ),
    "place": (
        (
            "place the {block} block on the {zone} zone",
            "put the {block} block in the {zone} target",
            "move the {block} cube onto the {zone} circle",
            "set the {block} block down on the {zone} zone",
        ),
        (
            "carry the {block} cube to the {zone} area and let go",
            "drop off the {block} block at the {zone} marker",
        ),
    ),
    "sort": (
        (
            "put the {block} block on the {zone} zone, then the {block2} block on the {zone2} zone",
            "first place the {block} block in the {zone} target, then the {block2} block in the {zone2} target",
            "move the {block} cube to the {zone} circle and after that the {block2} cube to the {zone2} circle",
            "place the {block} block on {zone}, then place the {block2} block on {zone2}",
        ),
        (
            "start with the {block} cube into the {zone} area, and finish with the {block2} cube into the {zone2} area",
            "sort the blocks: {block} goes to the {zone} marker first, {block2} to the {zone2} marker next",
        ),
    ),
}


def instructions(task: str, split: Split = "train") -> tuple[str, ...]:
    """Instruction templates of ``task`` for a split.

    Templates contain ``{block}`` and/or ``{zone}`` (plus ``{block2}``, ``{zone2}``
    for ``sort``), filled with colour names from ``BLOCKS`` and ``ZONES``.
    """
    if task not in _TEMPLATES:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    train, heldout = _TEMPLATES[task]
    if split == "train":
        return train
    if split == "heldout":
        return heldout
    if split == "all":
        return train + heldout
    raise ValueError(f"unknown split {split!r}; expected 'train', 'heldout' or 'all'")


@dataclass(frozen=True)
class Stage:
    """One sub-goal: ``block`` (None for reach) should end up in ``zone`` (None for pick)."""

    block: str | None
    zone: str | None


def load_model() -> mujoco.MjModel:
    """Compile the tabletop MJCF shipped in ``robo_post.sim_assets``."""
    xml = (files("robo_post.sim_assets") / "tabletop.xml").read_text()
    return mujoco.MjModel.from_xml_string(xml)


class TabletopEnv(gym.Env[dict[str, Any], np.ndarray]):
    """Language-conditioned tabletop tasks with a two-finger gripper.

    Observation (``spaces.Dict``):
        ``proprio``: float32 ``(PROPRIO_DIM,)``, laid out as ``PROPRIO_FIELDS``.
        ``task_id``: index of ``task`` in ``TASKS``.
        ``image``: uint8 ``(image_size, image_size, 3)`` from the fixed ``front``
        camera; only when ``render_images``. With ``render_every=k`` the frame is
        re-rendered every k steps and repeated in between.
    Action: ``Box(-1, 1, (4,))`` = (dx, dy, dz, gripper). The first three move the
        end-effector target by up to ``MAX_DELTA`` metres per step; gripper -1 is
        fully open, +1 fully closed (position control, so it squeezes when blocked).
    Info: ``instruction`` (str), ``success`` (bool), ``progress`` (float in [0, 1]).

    Args:
        task: one of ``TASKS``.
        render_images: include ``obs["image"]``.
        image_size: side of the observation image in pixels.
        render_every: re-render the observation image every this many steps.
        max_steps: truncation horizon; ``DEFAULT_MAX_STEPS[task]`` when None.
        instruction_split: which phrasings to draw from (see ``instructions``).
        render_mode: None or ``"rgb_array"`` (``render()`` returns a larger frame).
        render_size: side of the ``render()`` frame in pixels.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1.0 / CONTROL_DT))}

    def __init__(
        self,
        task: str = "reach",
        render_images: bool = True,
        image_size: int = 64,
        render_every: int = 1,
        max_steps: int | None = None,
        instruction_split: Split = "train",
        render_mode: str | None = None,
        render_size: int = 256,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        if render_every < 1 or image_size < 1:
            raise ValueError("render_every and image_size must be positive")
        instructions(task, instruction_split)  # validates the split early

        self.task = task
        self.task_id = TASKS.index(task)
        self.render_images = render_images
        self.image_size = image_size
        self.render_every = render_every
        self.max_steps = DEFAULT_MAX_STEPS[task] if max_steps is None else max_steps
        self.instruction_split: Split = instruction_split
        self.render_mode = render_mode
        self.render_size = render_size

        self.model = load_model()
        self.data = mujoco.MjData(self.model)
        global_vis = self.model.vis.global_
        global_vis.offwidth = max(global_vis.offwidth, image_size, render_size)
        global_vis.offheight = max(global_vis.offheight, image_size, render_size)
        self._hand_qpos = np.array([self.model.joint(f"hand_{a}").qposadr[0] for a in "xyz"])
        self._finger_qpos = np.array([self.model.joint(f"finger_{s}").qposadr[0] for s in ("left", "right")])
        self._block_qpos = np.array([self.model.joint(f"block_{b}").qposadr[0] for b in BLOCKS])
        self._zone_mocap = np.array([self.model.body(f"zone_{z}").mocapid[0] for z in ZONES])
        self._camera = self.model.camera("front").id

        obs_spaces: dict[str, spaces.Space] = {
            "proprio": spaces.Box(-np.inf, np.inf, (PROPRIO_DIM,), np.float32),
            "task_id": spaces.Discrete(len(TASKS)),
        }
        if render_images:
            obs_spaces["image"] = spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)

        self._obs_renderer: mujoco.Renderer | None = None
        self._frame_renderer: mujoco.Renderer | None = None
        self._image: np.ndarray | None = None
        self._target = np.zeros(3)
        self._steps = 0
        self._stage = 0
        self._carried = False
        self.stages: tuple[Stage, ...] = ()
        self.instruction = ""

    # ------------------------------------------------------------------ state
    @property
    def ee_position(self) -> np.ndarray:
        """World position of the grasp point between the fingertips."""
        return self.data.qpos[self._hand_qpos].copy()  # the hand joints are the grasp point's xyz

    @property
    def gripper_gap(self) -> float:
        """Distance between the finger pads (m)."""
        return float(self.data.qpos[self._finger_qpos].sum())

    @property
    def stage(self) -> int:
        """Index of the current stage; ``len(stages)`` once the task is done."""
        return self._stage

    def block_position(self, block: str) -> np.ndarray:
        """World position of a block's centre."""
        qadr = self._block_qpos[BLOCKS.index(block)]
        return self.data.qpos[qadr : qadr + 3].copy()

    def zone_position(self, zone: str) -> np.ndarray:
        """World position of a zone's centre (on the table, z = 0)."""
        xyz = self.data.mocap_pos[self._zone_mocap[ZONES.index(zone)]].copy()
        xyz[2] = 0.0
        return xyz

    def block_in_zone(self, block: str, zone: str) -> bool:
        """Whether ``block`` rests on the table inside ``zone``."""
        p = self.block_position(block)
        dist = np.linalg.norm(p[:2] - self.zone_position(zone)[:2])
        return bool(dist < SUCCESS_RADIUS and p[2] < RESTING_HEIGHT)

    # --------------------------------------------------------------- gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        rng = self.np_random
        mujoco.mj_resetData(self.model, self.data)

        self.stages = self._sample_stages(rng)
        zones_xy, blocks_xy = self._sample_layout(rng)
        for i, qadr in enumerate(self._block_qpos):
            yaw = rng.uniform(-0.25, 0.25)
            self.data.qpos[qadr : qadr + 3] = (*blocks_xy[i], BLOCK_HALF)
            self.data.qpos[qadr + 3 : qadr + 7] = (np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))
        for i, mid in enumerate(self._zone_mocap):
            self.data.mocap_pos[mid] = (*zones_xy[i], 0.001)

        ee = np.array([rng.uniform(-0.05, 0.05), rng.uniform(-0.2, -0.15), rng.uniform(0.12, 0.16)])
        self.data.qpos[self._hand_qpos] = ee
        self.data.qpos[self._finger_qpos] = FINGER_OPEN
        self._target = ee.copy()
        self.data.ctrl[:3] = ee
        self.data.ctrl[3:5] = FINGER_OPEN
        mujoco.mj_forward(self.model, self.data)

        templates = instructions(self.task, self.instruction_split)
        self.instruction = self._fill(templates[int(rng.integers(len(templates)))])
        self._steps = 0
        self._stage = 0
        self._carried = False  # push only: the block was lifted at some step (PUSH_MAX_HEIGHT)
        if self.render_images:
            self._image = self._render_obs()
        return self._get_obs(), self._info(success=False)

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(4), -1.0, 1.0)
        ee = self.ee_position
        target = np.clip(self._target + a[:3] * MAX_DELTA, ee - MAX_LEAD, ee + MAX_LEAD)
        self._target = np.clip(target, WORKSPACE_LOW, WORKSPACE_HIGH)
        self.data.ctrl[:3] = self._target
        self.data.ctrl[3:5] = FINGER_OPEN * (1.0 - a[3]) / 2.0
        mujoco.mj_step(self.model, self.data, nstep=N_SUBSTEPS)
        self._steps += 1
        if self.task == "push":
            self._carried |= bool(self.block_position(self.stages[0].block)[2] > PUSH_MAX_HEIGHT)

        while self._stage < len(self.stages) and self._stage_done(self._stage):
            self._stage += 1
        success = self._stage == len(self.stages)
        truncated = not success and self._steps >= self.max_steps
        if self.render_images and self._steps % self.render_every == 0:
            self._image = self._render_obs()
        return self._get_obs(), float(success), success, truncated, self._info(success)

    def render(self) -> np.ndarray | None:
        """A ``render_size`` square RGB frame from the front camera (``rgb_array`` mode)."""
        if self.render_mode != "rgb_array":
            return None
        if self._frame_renderer is None:
            self._frame_renderer = mujoco.Renderer(self.model, self.render_size, self.render_size)
        self._frame_renderer.update_scene(self.data, camera=self._camera)
        return self._frame_renderer.render().copy()

    def close(self) -> None:
        for renderer in (self._obs_renderer, self._frame_renderer):
            if renderer is not None:
                renderer.close()
        self._obs_renderer = self._frame_renderer = None

    # --------------------------------------------------------------- helpers
    def _sample_stages(self, rng: np.random.Generator) -> tuple[Stage, ...]:
        blocks = [BLOCKS[i] for i in rng.permutation(len(BLOCKS))]
        zones = [ZONES[i] for i in rng.permutation(len(ZONES))]
        if self.task == "reach":
            return (Stage(None, zones[0]),)
        if self.task == "pick":
            return (Stage(blocks[0], None),)
        if self.task == "sort":
            return (Stage(blocks[0], zones[0]), Stage(blocks[1], zones[1]))
        return (Stage(blocks[0], zones[0]),)

    def _sample_layout(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Rejection-sample zone and block xy positions that keep every task feasible.

        Zones do not overlap, blocks are far enough apart for an open gripper to
        descend between them, no block starts inside a zone, and for ``push`` the
        corridor from the block to its zone (plus room for the pusher) is clear.
        """
        e = LAYOUT_HALF_EXTENT
        while True:
            zones = rng.uniform(-e, e, size=(len(ZONES), 2))
            blocks = rng.uniform(-e, e, size=(len(BLOCKS), 2))
            if _min_pairwise(zones) < 0.13 or _min_pairwise(blocks) < 0.10:
                continue
            if np.min(np.linalg.norm(blocks[:, None] - zones[None], axis=-1)) < 0.085:
                continue
            if self.task == "push" and not self._push_corridor_clear(zones, blocks):
                continue
            return zones, blocks

    def _push_corridor_clear(self, zones: np.ndarray, blocks: np.ndarray) -> bool:
        stage = self.stages[0]
        b, z = BLOCKS.index(stage.block), ZONES.index(stage.zone)
        start, goal = blocks[b], zones[z]
        length = np.linalg.norm(goal - start)
        if not 0.10 <= length <= 0.24:
            return False
        # The pusher stands ~5 cm behind the block; nothing else may sit on that line.
        u = (goal - start) / length
        seg_start = start - 0.06 * u
        others = np.delete(blocks, b, axis=0)
        return bool(np.all(_point_segment_distance(others, seg_start, goal) > 0.075))

    def _fill(self, template: str) -> str:
        first, second = self.stages[0], self.stages[-1]
        return template.format(block=first.block, zone=first.zone, block2=second.block, zone2=second.zone)

    def _stage_done(self, k: int) -> bool:
        stage = self.stages[k]
        if self.task == "reach":
            ee = self.ee_position
            dist = np.linalg.norm(ee[:2] - self.zone_position(stage.zone)[:2])
            return bool(dist < REACH_RADIUS and ee[2] < REACH_HEIGHT)
        if self.task == "pick":
            return bool(self.block_position(stage.block)[2] > LIFT_HEIGHT)
        if not self.block_in_zone(stage.block, stage.zone):
            return False
        if self.task == "push":
            return not self._carried
        # place / sort: the block must be let go, and earlier stages must still hold.
        released = self.gripper_gap > RELEASED_GAP
        return released and all(self.block_in_zone(s.block, s.zone) for s in self.stages[:k])

    def _render_obs(self) -> np.ndarray:
        if self._obs_renderer is None:
            self._obs_renderer = mujoco.Renderer(self.model, self.image_size, self.image_size)
        self._obs_renderer.update_scene(self.data, camera=self._camera)
        return self._obs_renderer.render().copy()

    def _get_obs(self) -> dict[str, Any]:
        current = self.stages[min(self._stage, len(self.stages) - 1)]
        target_block = np.zeros(len(BLOCKS))
        target_zone = np.zeros(len(ZONES))
        ee = self.ee_position
        block_rel, zone_rel = np.zeros(3), np.zeros(2)
        if current.block is not None:
            target_block[BLOCKS.index(current.block)] = 1.0
            block_rel = self.block_position(current.block) - ee
        if current.zone is not None:
            target_zone[ZONES.index(current.zone)] = 1.0
            origin = ee if current.block is None else self.block_position(current.block)
            zone_rel = self.zone_position(current.zone)[:2] - origin[:2]
        proprio = np.concatenate(
            [
                self.ee_position,
                [self.gripper_gap],
                *(self.block_position(b) for b in BLOCKS),
                self.data.mocap_pos[self._zone_mocap, :2].ravel(),
                target_block,
                target_zone,
                [self._progress()],
                block_rel,
                zone_rel,
            ]
        ).astype(np.float32)
        obs: dict[str, Any] = {"proprio": proprio, "task_id": np.int64(self.task_id)}
        if self.render_images:
            obs["image"] = self._image.copy()
        return obs

    def _progress(self) -> float:
        return self._stage / len(self.stages)

    def _info(self, success: bool) -> dict[str, Any]:
        return {"instruction": self.instruction, "success": bool(success), "progress": self._progress()}


def _min_pairwise(points: np.ndarray) -> float:
    dists = np.linalg.norm(points[:, None] - points[None], axis=-1)
    return float(np.min(dists[np.triu_indices(len(points), k=1)]))


def _point_segment_distance(points: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ab = b - a
    t = np.clip((points - a) @ ab / (ab @ ab), 0.0, 1.0)
    return np.linalg.norm(points - (a + t[:, None] * ab), axis=-1)
