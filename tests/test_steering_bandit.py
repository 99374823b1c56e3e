"""The bandit selector: picks the alpha that reaches the goal, keeps the frozen actor when no alpha beats it."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import torch

from robo_post.envs.point_mass import goal_pd
from robo_post.envs.registry import env_spec, make_prior
from robo_post.models.gaussian import Gaussian
from robo_post.steering.auto import select_alpha_auto
from robo_post.steering.bandit import halving_plan, select_alpha_bandit
from robo_post.steering.evaluate import Rollouts, oracle_set, run_episodes
from robo_post.steering.poe import SteeringConfigError, select_alpha
from robo_post.steering.policy import SteeredPolicy, SteeringConfig
from robo_post.steering.sources import QUALITIES, ScriptedPrior
from robo_post.store.registry import PolicyRegistry
from tests.helpers import run_cli

GRID = (0.1, 0.3, 0.5, 0.7, 0.9)
OLD_GOAL = np.array([0.5, 0.5], np.float32)


def synthetic(success_rate, return_shift=lambda a: 0.0):
    """``play`` of an env where alpha reaches the goal with probability ``success_rate(alpha)``; a
    success adds 5 to the return. The episode's seed draws the rest, the same for every arm (paired)."""
    def play(alpha, seeds):
        u, base = np.array([(g.random(), g.normal(-10.0, 1.0)) for g in map(np.random.default_rng, seeds)]).T
        reached = u < success_rate(alpha)
        return SimpleNamespace(returns=base + 5.0 * reached + return_shift(alpha), successes=reached.astype(float))
    return play


def test_halving_plan_splits_the_budget_over_rounds_and_names_the_minimum():
    # 5 grid arms: rounds of 5, 3 and 2 arms, each with alpha = 0: 60 // (3 * 6), 60 // (3 * 4), 60 // (3 * 3)
    assert halving_plan(5, 60) == [3, 5, 6]
    assert halving_plan(5, 18) == [1, 1, 2]
    assert halving_plan(1, 4) == [2]  # one arm: one round, two paired episodes for its bound
    with pytest.raises(SteeringConfigError, match="budget of 17 episodes is too small for 5 grid alphas .*least 18"):
        halving_plan(5, 17)
    with pytest.raises(SteeringConfigError, match="at least one grid alpha"):
        halving_plan(0, 60)


def test_bandit_picks_the_clearly_better_alpha_and_counts_its_episodes():
    choice = select_alpha_bandit(synthetic(lambda a: 0.95 if a == 0.7 else 0.05), GRID, 60, seed=100)
    assert choice.alpha == 0.7 and choice.survivor == 0.7
    # alpha = 0 and the survivor play every round (3 + 5 + 6); the rest leave after round 1 or 2
    assert choice.episodes == 6 * 3 + 4 * 5 + 3 * 6 == 56
    assert choice.arms[0.0]["episodes"] == choice.arms[0.7]["episodes"] == 14
    assert choice.rounds[0] == list(GRID) and len(choice.rounds[1]) == 3 and len(choice.rounds[2]) == 2
    assert choice.arms[0.7]["success"] > 0.8 and choice.lcb_success > 0
    # alpha_max takes the best arm out of play: the bandit picks among the rest or stays frozen
    capped = select_alpha_bandit(synthetic(lambda a: 0.95 if a == 0.7 else 0.05), GRID, 60, alpha_max=0.5, seed=100)
    assert capped.alpha == 0.0 and capped.rounds[0] == [0.1, 0.3, 0.5]
    assert capped.episodes == 4 * 7 + 3 * 10 == 58  # 3 arms, 2 rounds: 60 // (2 * 4), then 60 // (2 * 3)


def test_bandit_keeps_alpha_zero_unless_a_gain_clears_the_margin():
    same = lambda a: 0.3  # noqa: E731 - no alpha changes the success rate
    tiny = select_alpha_bandit(synthetic(same, lambda a: 0.05 * a), GRID, 60, seed=7)  # < 1% of |return ~ -8.5|
    assert tiny.alpha == 0.0 and tiny.survivor == 0.9 and tiny.lcb_return > 0 and tiny.lcb_return < tiny.threshold
    assert select_alpha_bandit(synthetic(same, lambda a: 0.05 * a), GRID, 60, margin=0.0, seed=7).alpha == 0.9
    worse = select_alpha_bandit(synthetic(lambda a: 0.3 - 0.3 * a, lambda a: -2.0 * a), GRID, 60, seed=7)
    assert worse.alpha == 0.0 and worse.survivor == 0.1 and worse.lcb_return < 0


def test_one_lucky_success_does_not_make_an_alpha_that_loses_return_the_oracle():
    """The grid's overconfident random prior on the point mass: alpha 0.9 reached the goal in 2 of
    200 episodes, the frozen actor in 1, at a return lower by about 9."""
    rng = np.random.default_rng(0)
    frozen = rng.normal(-90.0, 5.0, 200)
    one, two = np.zeros(200), np.zeros(200)
    one[3] = two[3] = two[150] = 1.0
    arms = {0.0: Rollouts(frozen, one), 0.1: Rollouts(frozen - 0.4 + rng.normal(0, 0.3, 200), one),
            0.9: Rollouts(frozen - 9.0 + rng.normal(0, 3.0, 200), two)}
    assert oracle_set(arms, margin=0.9) == (0.0, [0.0, 0.1])  # before: oracle 0.9 and every alpha tied
    # a success rate higher with confidence still ranks first, whatever the return
    reach = np.r_[np.ones(150), np.zeros(50)]
    arms[0.5] = Rollouts(frozen - 20.0, reach)
    assert oracle_set(arms, margin=0.9) == (0.5, [0.5])


def point_mass_play(prior_quality, episodes_log):
    """Real point-mass episodes: the frozen actor is the PD controller aimed at the old goal with std 0.3,
    the prior the env's PD controller toward the observed goal, in the given quality."""
    spec = env_spec("point_mass")
    env = spec.make(None)
    low, high = env.action_space.low, env.action_space.high
    actor = ScriptedPrior(lambda obs: goal_pd({**obs, "goal": np.broadcast_to(OLD_GOAL, obs["goal"].shape)}),
                          low, high, std=0.3)
    prior = ScriptedPrior(goal_pd, low, high, seed=1, **QUALITIES[prior_quality])

    def play(alpha, seeds):
        episodes_log.append(len(seeds))
        policy = SteeredPolicy(actor, prior, SteeringConfig("poe", alpha), low, high)
        return run_episodes(lambda: spec.make(None), policy.act, policy.reset, seeds, spec.success)
    return play


def test_on_point_mass_episodes_the_bandit_reaches_new_goals_and_keeps_the_actor_with_a_random_prior():
    log = []
    good = select_alpha_bandit(point_mass_play("good", log), GRID, 18, seed=500)
    assert good.alpha >= 0.5 and good.arms[good.alpha]["success"] == 1.0 and good.arms[0.0]["success"] <= 0.25
    assert good.episodes == sum(log) == 6 * 1 + 4 * 1 + 3 * 2 == 16
    log.clear()
    honest = select_alpha_bandit(point_mass_play("random_honest", log), GRID, 18, seed=500)
    assert honest.alpha == 0.0 and honest.episodes == sum(log) == 16
    assert honest.lcb_success <= 0 and honest.lcb_return <= honest.threshold


class Fixed:
    """A source with the same Gaussian at every state."""

    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def reset(self, seed):
        pass

    def distribution(self, obs):
        n = len(obs["x"])
        return Gaussian(torch.full((n, 1), self.mean), torch.full((n, 1), float(np.log(self.std))))


def test_auto_reads_success_where_the_env_reports_it_and_the_kl_budget_elsewhere():
    states = {"x": np.zeros((40, 1), np.float32)}
    actor, prior = Fixed(0.0, 0.3), Fixed(1.0, 0.3)
    played = []

    def play(alpha, seeds):
        played.append(alpha)
        return synthetic(lambda a: 0.95 if a == 0.7 else 0.05)(alpha, seeds)

    # no success in the frozen calibration episodes: the KL budget on their states, no steered episode
    alpha, record = select_alpha_auto(Rollouts(np.zeros(4), None, states), actor, prior, play, GRID, 2.0, 60)
    expected, kls = select_alpha(actor.distribution(states), prior.distribution(states), GRID, 2.0)
    assert (alpha, record["kind"], record["kl_curve"]) == (expected, "kl_budget", kls) and played == []
    assert 0 < alpha < 0.9 and record["states"] == 40
    # success reported: the bandit, which finds the alpha that reaches the goal whatever its KL
    alpha, record = select_alpha_auto(Rollouts(np.zeros(4), np.zeros(4), states), actor, prior, play, GRID, 2.0, 60,
                                      seed=100)
    assert alpha == 0.7 > expected and record["kind"] == "bandit" and record["episodes"] == 56
    assert record["frozen_calibration_success"] == 0.0 and set(played) == {0.0, *GRID}


OLD_TARGET = np.array([0.1, 0.1])
NEW_TARGET = [-0.1, -0.1]


def reacher_at_new_target(quality):
    """Reacher with every target at NEW_TARGET; the frozen actor is the env's Jacobian-transpose controller
    aimed at OLD_TARGET (std 0.3), so it never reaches the new one; the prior aims at the observed target."""
    spec = env_spec("reacher")
    make = lambda: spec.make(None, target=NEW_TARGET)  # noqa: E731
    env = make()
    low, high = env.action_space.low, env.action_space.high
    controller = make_prior(spec, None, env)

    def old_target(obs):
        o = np.array(obs["observation"], np.float64)
        o[:, 8:10] += o[:, 4:6] - OLD_TARGET  # fingertip - target, for the old target
        o[:, 4:6] = OLD_TARGET
        return controller({"observation": o.astype(np.float32)})

    actor = ScriptedPrior(old_target, low, high, std=0.3)
    prior = ScriptedPrior(controller, low, high, seed=1, **QUALITIES[quality])

    def episodes(alpha, seeds, keep_states=False):
        policy = SteeredPolicy(actor, prior, SteeringConfig("poe", alpha), low, high)
        return run_episodes(make, policy.act, policy.reset, seeds, spec.success, keep_states)
    return actor, prior, episodes


@pytest.mark.parametrize("quality", ["good", "random_honest"])
def test_auto_steers_a_frozen_actor_to_a_new_reacher_target_and_keeps_it_with_a_random_prior(quality):
    actor, prior, episodes = reacher_at_new_target(quality)
    frozen = episodes(0.0, range(900, 910), keep_states=True)
    alpha, record = select_alpha_auto(frozen, actor, prior, episodes, GRID, 2.0, 18, seed=500)
    assert record["kind"] == "bandit" and frozen.successes.sum() == 0
    evaluation = range(40)  # seeds apart from the calibration's
    reached = episodes(alpha, evaluation).successes.mean()
    if quality == "good":
        assert alpha >= 0.5 and reached >= 0.9  # 0.5 reaches it in 40 of 40 (0.3: none)
        # the KL budget stays near the actor, which misses the new target (KL at 0.5: 3.8 nats)
        kl_alpha, _ = select_alpha(actor.distribution(frozen.states), prior.distribution(frozen.states), GRID, 2.0)
        assert kl_alpha < alpha and episodes(kl_alpha, evaluation).successes.mean() == 0.0
    else:  # the frozen actor itself: never HURT
        assert alpha == 0.0 and reached == 0.0


def _point_mass_actor(root):
    """An untrained Gaussian actor for the point mass (position and velocity), published in ``root``."""
    from robo_post.models.features import Feature
    from robo_post.models.gaussian import GaussianPolicy, GaussianPolicyConfig

    features = {"position": Feature("state", (2,)), "velocity": Feature("state", (2,))}
    model = GaussianPolicy(GaussianPolicyConfig(features=features, action_dim=2, embed_dim=8, hidden_dim=16,
                                                action_low=[-1.0, -1.0], action_high=[1.0, 1.0]))
    PolicyRegistry(root).publish(*model.artifact(algorithm="untrained"))
    return root


def test_steer_with_the_bandit_records_its_choice_and_spent_episodes(tmp_path):
    actor = _point_mass_actor(str(tmp_path / "actor"))
    out = str(tmp_path / "deploy")
    summary = json.loads(run_cli("steer", "actor.kind=registry", f"actor.store={actor}", "selector.kind=bandit",
                                 "selector.bandit_episodes=18", "episodes=2", "fleet.n_clients=1", f"store={out}",
                                 "show=false").stdout)
    selection = summary["selection"]
    assert selection["kind"] == "bandit" and selection["episodes"] == 16 and selection["bandit_episodes"] == 18
    assert summary["steering"]["alpha"] == selection["alpha"] > 0  # an untrained actor never reaches the goal
    assert selection["arms"][f"{selection['alpha']:g}"]["success"] > selection["arms"]["0"]["success"]
    _, config = PolicyRegistry(out).load(summary["version"])
    assert config["steering"]["alpha"] == selection["alpha"] and config["selection"]["kind"] == "bandit"


def test_steer_with_auto_plays_the_bandit_on_an_env_that_reports_success(tmp_path):
    actor = _point_mass_actor(str(tmp_path / "actor"))
    out = str(tmp_path / "deploy")
    summary = json.loads(run_cli("steer", "actor.kind=registry", f"actor.store={actor}", "selector.kind=auto",
                                 "selector.kl_budget=0.5", "selector.episodes=2", "selector.bandit_episodes=18",
                                 "episodes=2", "fleet.n_clients=1", f"store={out}", "show=false").stdout)
    selection = summary["selection"]
    assert selection["selector"] == "auto" and selection["kind"] == "bandit" and selection["episodes"] == 16
    assert selection["frozen_calibration_success"] == 0.0  # an untrained actor never reaches the goal
    assert summary["steering"]["alpha"] == selection["alpha"] > 0
    _, config = PolicyRegistry(out).load(summary["version"])
    assert config["selection"]["selector"] == "auto" and config["steering"]["alpha"] == selection["alpha"]


@pytest.mark.parametrize("command, overrides, names", [
    ("steer", ["selector.kind=ucb"], ["selector.kind='ucb'", "'kl_budget' | 'bandit'"]),
    ("steer", ["selector.kind=bandit", "selector.bandit_episodes=3"], ["selector.bandit_episodes=3", "integer >= 4"]),
    ("steer", ["selector.kind=bandit", "selector.margin=-0.1"], ["selector.margin=-0.1", "[0, inf)"]),
    ("steer-eval", ["bandit_episodes=[30,30]"], ["bandit_episodes=[30, 30]", "item 1 repeats item 0"]),
    ("steer-eval", ["bandit_episodes=[2]"], ["bandit_episodes=[2]", "episode budgets >= 4; item 0 is 2"]),
    ("steer-eval", ["bandit_margin=inf"], ["bandit_margin=inf", "[0, inf)"]),
])
def test_bad_bandit_settings_are_one_line_config_errors(tmp_path, command, overrides, names):
    paths = {"steer": [f"store={tmp_path / 's'}"], "steer-eval": [f"out_dir={tmp_path / 'o'}"]}[command]
    r = run_cli(command, "actor.kind=registry", *paths, *overrides, ok=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and all(n in r.stderr for n in names), r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overrides, message", [
    (["selector.kind=bandit", "selector.kl_budget=2"], "selector.kl_budget=2 is read by selector.kind=kl_budget"),
    (["selector.kind=bandit", "selector.bandit_episodes=10"],
     "selector.bandit_episodes=10: a bandit budget of 10 episodes is too small for 5 grid alphas .* at least 18"),
    (["selector.kind=bandit", "selector.alpha_max=0.05"], "selector.bandit_episodes=60: .*at least one grid alpha"),
    (["selector.kind=auto"], "selector.kind=auto needs selector.kl_budget"),
    (["selector.kind=auto", "selector.kl_budget=0.5", "selector.store=x"], "selector.store=x is read by "),
    (["selector.kind=auto", "selector.kl_budget=0.5", "selector.bandit_episodes=10"],
     "selector.bandit_episodes=10: a bandit budget of 10 episodes is too small"),
])
def test_bandit_settings_that_do_not_fit_together_fail_before_anything_is_written(tmp_path, overrides, message):
    from robo_post.config import compose as compose_config
    from robo_post.pipelines.steer import steer

    out = str(tmp_path / "deploy")
    cfg = compose_config("steer", ["actor.kind=registry", f"actor.store={tmp_path / 'none'}", f"store={out}",
                                   "show=false", *overrides])
    with pytest.raises(SteeringConfigError, match=message):
        steer(cfg)
    assert os.listdir(tmp_path) == []
