"""The hydra jobs' composed configs at the command line: checked up front, printed, explained.

``check_config`` runs before a job touches the disk: every key a user set must be one
the job knows (hydra lets ``+key=value`` add any key), every value must have the type
of its default and lie in its allowed range or choices, and the torch device must
exist here. A violation is a ``ConfigError`` naming the key, the value and what is
allowed. ``job_help`` prints a job's config groups with their choices and the YAML
sources (one comment per option) of the files the overrides select.
"""

from __future__ import annotations

import importlib.resources
import math
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

from robo_post.config import compose
from robo_post.store.schema import ROLES

# Dicts whose keys are free-form (passed through to a class, an env or a policy) at any level below.
FREE_FORM = ("algo.critic", "algo.value", "algo.actor", "algo.hyperparameters", "algo.agent_hyperparameters",
             "algo.env_kwargs", "algo.heldout_kwargs", "algo.model", "env.kwargs", "env_kwargs", "policy", "model.features",
             "lwd.critic", "lwd.value", "lwd.actor", "tracking.wandb", "tracking.mlflow", "lwd.tracking.wandb",
             "lwd.tracking.mlflow")
MISSING = "???"


class ConfigError(ValueError):
    """A config value (or key) a job cannot use; names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str, message: str | None = None):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(message or f"{key}={_show(value)} is not allowed; expected {allowed}")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value).replace("None", "null")


# --- value checks: each raises ConfigError(key, value, allowed) -------------------------
Check = Callable[[str, Any], None]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(low: int, optional: bool = False) -> Check:
    """An integer >= ``low`` (or null when ``optional``)."""
    def check(key: str, v: Any) -> None:
        if not ((optional and v is None) or (_is_int(v) and v >= low)):
            raise ConfigError(key, v, f"an integer >= {low}" + (" or null" if optional else ""))
    return check


def number(low: float, high: float | None = None, low_open: bool = False, high_open: bool = False,
           optional: bool = False) -> Check:
    """A finite number in [low, high] (``low_open`` / ``high_open``: excluding that end; no ``high``:
    any finite number above ``low``), or null when ``optional``."""
    lo = ("(" if low_open else "[") + f"{low:g}"
    hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")

    def check(key: str, v: Any) -> None:
        # inf passed `v >= low` and reached the job (a JSON record refuses it, a std of inf divides to NaN)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
            v > low if low_open else v >= low) and (high is None or (v < high if high_open else v <= high))
        if not (ok or (optional and v is None)):
            raise ConfigError(key, v, f"a number in {lo}, {hi}" + (" or null" if optional else ""))
    return check


def choice(*values: Any, optional: bool = False) -> Check:
    """One of ``values`` (or null when ``optional``)."""
    def check(key: str, v: Any) -> None:
        if not ((optional and v is None) or (isinstance(v, (str, bool)) and v in values)):
            raise ConfigError(key, v, "one of " + " | ".join(map(_show, values)) + (" | null" if optional else ""))
    return check


def text(optional: bool = False) -> Check:
    """A non-empty string (a path, a name), or null when ``optional``."""
    def check(key: str, v: Any) -> None:
        if not ((optional and v is None) or (isinstance(v, (str, int)) and str(v) not in ("", MISSING))):
            raise ConfigError(key, v, "a non-empty string" + (" or null" if optional else ""))
    return check


def items(item: Check, what: str, single: bool = False, optional: bool = True, unique: bool = False) -> Check:
    """A list of values passing ``item`` (or one such value when ``single``; null when ``optional``;
    each once when ``unique``: a sweep's repeated point would be run and reported twice)."""
    def check(key: str, v: Any) -> None:
        if (optional and v is None) or (single and not isinstance(v, list)):
            if v is not None:
                item(key, v)
            return
        if not isinstance(v, list) or not v:
            raise ConfigError(key, v, f"a non-empty list of {what}" + (" or null" if optional else ""))
        for i, x in enumerate(v):
            try:
                item(key, x)
            except ConfigError:
                raise ConfigError(key, v, f"a list of {what}; item {i} is {_show(x)}") from None
            if unique and x in v[:i]:
                raise ConfigError(key, v, f"a list of {what}, each once; item {i} repeats item {v.index(x)}")
    return check


def device(key: str, v: Any) -> None:
    """``auto``, or a torch device that exists on this machine."""
    if v in ("auto", "cpu"):
        return
    import torch

    try:
        dev = torch.device(v)
    except (RuntimeError, TypeError):
        raise ConfigError(key, v, "auto | cpu | cuda | cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(key, v, "auto | cpu", f"{key}={v} but CUDA is not available; use {key}=cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(key, v, f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(key, v, "auto | cpu", f"{key}={v} but MPS is not available; use {key}=cpu or auto")


def method(key: str, v: Any) -> None:
    """A registered training method (plugins included)."""
    from robo_post.algos.registry import METHODS, UnknownMethodError, method_spec

    try:
        method_spec(str(v))
    except UnknownMethodError:
        raise ConfigError(key, v, "a registered method: " + " | ".join(sorted(METHODS))) from None


def boolean(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(key, v, "true | false")


def _version(key: str, v: Any) -> None:
    """Registry versions to evaluate: latest, a number (0 = the ``policy`` run), null, or a list of those."""
    def one(x: Any) -> bool:
        return x is None or x == "latest" or (_is_int(x) and x >= 0)

    if not (one(v) or (isinstance(v, list) and v and all(one(x) for x in v))):
        raise ConfigError(key, v, "latest | a version number >= 0 | null | a non-empty list of those")


def _registry_version(key: str, v: Any) -> None:
    """One published version to load: a number, latest, or null (= latest)."""
    if not (v is None or v == "latest" or (_is_int(v) and v >= 1)):
        raise ConfigError(key, v, "latest | a version number >= 1 | null")


_COUNT, _COUNT0 = integer(1), integer(0)


def _seed(key: str, v: Any) -> None:
    """What numpy, torch and gymnasium all take: 0 .. 2**63 - 1."""
    if not (_is_int(v) and 0 <= v < 2 ** 63):
        raise ConfigError(key, v, "an integer in [0, 2**63)")


_SPLIT = choice("train", "heldout")
_FLEET = {
    "fleet.n_clients": _COUNT, "fleet.max_restarts": _COUNT0, "fleet.layout_repeats": _COUNT,
    "fleet.policy_version": integer(1, optional=True), "fleet.role": choice(*ROLES, optional=True),
    "fleet.launcher": choice("local", "ray"), "fleet.client_prefix": text(), "fleet.num_cpus": _COUNT,
    "fleet.overseer.stall_steps": _COUNT, "fleet.overseer.takeover_steps": _COUNT,
    "fleet.overseer.stall_tol": number(0), "fleet.overseer.deadline": number(0, 1, low_open=True, optional=True),
}
_TRAIN = {
    "store": text(), "run_dir": text(), "device": device, "torch_threads": _COUNT, "updates": integer(1, optional=True), "epochs": number(0, low_open=True), "seed": _seed,
    "batch_size": _COUNT, "gamma": number(0, 1, low_open=True), "prefetch": _COUNT0, "amp": choice("bf16", optional=True),
    "compile": boolean,
    "log_every": _COUNT, "checkpoint_every": _COUNT, "eval.every": _COUNT0, "eval.episodes_per_task": _COUNT,
    "data.snapshot": text(optional=True), "data.tasks": items(text(), "task ids"),
    "data.success": choice(True, False, optional=True), "data.roles": items(choice(*ROLES), "roles"),
    "data.clients": items(text(), "client-id prefixes"), "data.holdout": number(0, 0.5), "model.horizon": integer(1, optional=True),
    "model.execute_steps": integer(1, optional=True), "model.use_text": choice("auto", True, False),
    "model.embed_dim": _COUNT, "model.hidden_dim": _COUNT, "model.flow_steps": _COUNT, "model.deterministic": boolean, "model.mode_draws": _COUNT,
    "model.predicts": choice("chunk", "velocity"),
    "algo.name": method, "algo.lr": number(0, low_open=True), "algo.critic_warmup": integer(0, optional=True), "algo.best_of_n": _COUNT,
    "algo.n_step": integer(1, optional=True), "algo.reference_version": integer(1, optional=True), "algo.timesteps": _COUNT,
    "algo.n_envs": _COUNT, "algo.imitation.roles": items(choice(*ROLES), "roles", optional=False),
    "algo.lam": number(0, 1, low_open=True), "algo.E": _COUNT, "algo.eval_every": _COUNT0,
}
# Per job: key -> check of its resolved value (keys a job does not have are skipped).
RULES: dict[str, dict[str, Check]] = {
    # env.name null (env=store): the env the store was recorded in
    "collect": {"store": text(), "episodes": _COUNT, "env.name": text(optional=True), "env.tasks": items(text(), "task ids"),
                "policy.noise": number(0), "policy.mode": choice("expert", "near_miss"), **_FLEET},
    "train": _TRAIN,
    "eval": {
        "store": text(), "version": _version, "env.name": text(optional=True), "tasks": items(text(), "task ids"),
        "episodes_per_task": _COUNT, "split": items(_SPLIT, "splits (train | heldout)", single=True, optional=False),
        "n_clients": _COUNT, "out_store": text(optional=True), "device": device, "seed": _seed,
    },
    "report": {"run_dir": items(text(), "run dirs", single=True), "eval_store": text(optional=True),
               "results": items(text(), "result files"), "out_dir": text()},
    "run": {
        "run_dir": text(), "device": device, "seed": _seed, "env.name": text(), "env.tasks": items(text(), "task ids"),
        **_FLEET,
        "demos.episodes": _COUNT, "demos.noise": number(0), "play.episodes": _COUNT0, "play.noise": number(0),
        "play.mode": choice("near_miss", "expert"), "deploy.episodes": _COUNT0, "deploy.layout_repeats": _COUNT,
        "lwd.algo": choice("divl_qam", "iql_qam", "fql"), "lwd.device": device, "lwd.torch_threads": _COUNT,
        "lwd.reference_version": integer(1, optional=True), "lwd.gamma": number(0, 1, low_open=True),
        "lwd.batch_size": _COUNT, "lwd.log_every": _COUNT, "lwd.checkpoint_every": _COUNT,
        "lwd.critic_warmup": _COUNT0, "lwd.best_of_n": _COUNT, "lwd.offline.updates": _COUNT,
        "lwd.offline.n_step": _COUNT, "lwd.online.episodes": _COUNT0, "lwd.online.updates": _COUNT0,
        "lwd.online.publish_every": _COUNT, "lwd.online.utd": number(0, low_open=True),
        "lwd.online.poll_s": number(0, low_open=True), "lwd.online.n_step": _COUNT,
        "lwd.online.online_fraction": number(0, 1), "lwd.online.max_staleness": integer(0, optional=True),
        "lwd.imitation.roles": items(choice(*ROLES), "roles", optional=False),
        "eval.episodes_per_task": _COUNT, "eval.splits": items(_SPLIT, "splits (train | heldout)", optional=False),
        "eval.from_version": _COUNT, **{f"bc.{k}": c for k, c in _TRAIN.items() if k not in ("store", "run_dir", "device")},
    },
}
_STEER_SOURCES = {
    "actor.kind": choice("registry", "sb3"), "actor.store": text(optional=True), "actor.path": text(optional=True),
    "actor.algo": text(optional=True), "prior.kind": choice("scripted", "registry"),
    "prior.quality": choice("good", "degraded", "random_honest", "random_overconfident"),
    "prior.std": number(0, low_open=True, optional=True), "prior.noise": number(0, optional=True),
    "prior.random": choice(True, False, optional=True), "prior.seed": _COUNT0, "prior.store": text(optional=True),
    "actor.version": _registry_version, "prior.version": _registry_version,
    "device": device, "seed": _COUNT0, "env.name": text(),
}
_ALPHAS = items(number(0, 1, high_open=True), "alphas in [0, 1)", optional=False, unique=True)
RULES["steer"] = {
    **_STEER_SOURCES, **_FLEET, "store": text(), "episodes": _COUNT, "alpha": number(0, 1),
    "rule": choice("poe", "klreg", "additive", "prior", "frozen"), "klreg_form": choice("tilt", "geometric"),
    "additive_form": choice("mix", "residual"), "deterministic": boolean,
    "selector.kind": choice("kl_budget", "bandit", "auto"),
    "selector.kl_budget": number(0, optional=True), "selector.alpha_grid": _ALPHAS,
    "selector.alpha_max": number(0, 1, optional=True), "selector.episodes": _COUNT, "selector.store": text(optional=True),
    "selector.bandit_episodes": integer(4), "selector.margin": number(0),
}
RULES["steer-eval"] = {
    # one paired difference bootstraps to a zero-width CI: a HELP/HURT label from a single episode
    **_STEER_SOURCES, "episodes": integer(2), "calibration_episodes": _COUNT, "alpha_grid": _ALPHAS,
    "kl_budgets": items(number(0), "KL budgets >= 0", optional=False, unique=True),
    "bandit_episodes": items(integer(4), "episode budgets >= 4", unique=True), "bandit_margin": number(0),
    "alpha_max": number(0, 1, optional=True),
    "rules": items(choice("poe", "klreg", "additive"), "rules (poe | klreg | additive)", optional=False, unique=True),
    "qualities": items(choice("good", "degraded", "random_honest", "random_overconfident"), "prior qualities",
                       optional=False),
    "stochastic": boolean, "out_dir": text(), "margin": number(0),
}
# `robo-post run` reads `preset.*` through interpolations: check them first, under their own names.
RULES["run"] = {**{f"preset.{k}": _COUNT0 for k in ("play_episodes", "deploy_episodes", "critic_warmup",
                                                    "online_episodes", "online_updates")},
                **{f"preset.{k}": _COUNT for k in ("demo_episodes", "bc_updates", "eval_episodes", "offline_updates",
                                                   "online_publish_every")},
                **RULES["run"]}


# --- config groups and known keys ----------------------------------------------------------
def _configs():
    return importlib.resources.files("robo_post.configs")


def config_groups(job: str) -> dict[str, tuple[str | None, list[str]]]:
    """The config groups of ``configs/<job>.yaml``: group -> (default choice, available choices)."""
    defaults = OmegaConf.load(str(_configs() / f"{job}.yaml")).get("defaults", [])
    groups = {}
    for entry in defaults:
        if isinstance(entry, DictConfig):
            (group, default), = entry.items()
            names = sorted(p.name[:-5] for p in (_configs() / group).iterdir() if p.name.endswith(".yaml"))
            groups[str(group)] = (default, names)
    return groups


def _parse(override: str) -> tuple[str, str, str]:
    """(prefix, key, value) of a hydra override: ``+``/``++``/``~`` prefix, dotted key, raw value."""
    key, _, value = override.partition("=")
    stripped = key.lstrip("+~")
    return key[: len(key) - len(stripped)], stripped, value


def expand_overrides(job: str, overrides: list[str]) -> list[str]:
    """``overrides`` with ``env=ID`` for any gymnasium id rewritten to the generic env group;
    an override hydra cannot parse is a ``ConfigError`` naming it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from robo_post.envs.registry import expand_env_override

    parser = OverridesParser.create()
    parsed = []
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as e:
            key, _, value = override.partition("=")
            # hydra's grammar takes only ASCII unquoted: a plain non-ASCII value (a path such as
            # store=runs/données) is read as the quoted string it can only mean.
            quoted = f"{key}='{value}'"
            if value and not value.isascii() and not set(value) & set("'\"[]{}(),\\") and _parses(parser, quoted):
                override = quoted
            else:
                reason = str(e).splitlines()[0]
                raise ConfigError(key, value, "", f"cannot parse {override!r} ({reason}); expected KEY=VALUE, "
                                  "+KEY=VALUE or GROUP=CHOICE with hydra's value syntax") from None
        parsed.append(override)
    overrides = parsed
    groups = config_groups(job)
    return expand_env_override(overrides, groups["env"][1]) if "env" in groups else list(overrides)


def _parses(parser: Any, override: str) -> bool:
    from hydra.errors import HydraException

    try:
        parser.parse_override(override)
    except HydraException:
        return False
    return True


def _choices(job: str, overrides: list[str]) -> dict[str, str]:
    """The group choices the overrides make (checked against the yaml files of each group)."""
    groups, chosen = config_groups(job), {}
    for override in overrides:
        prefix, key, value = _parse(override)
        if key in groups and "~" not in prefix:
            if value not in groups[key][1]:
                allowed = " | ".join(groups[key][1]) + (" | any gymnasium id" if key == "env" else "")
                raise ConfigError(key, value, allowed)
            chosen[key] = value
    return chosen


def _defaults(job: str, chosen: dict[str, str]) -> dict[str, Any]:
    """The job's config with only the group choices applied, resolved (the reference for keys and types)."""
    cfg = compose(job, [f"{g}={c}" for g, c in chosen.items()])
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def _method_keys(name: str) -> dict[str, Any]:
    """``algo.*`` keys the method ``name`` reads (its config dataclass), if it is registered."""
    import dataclasses

    from robo_post.algos.registry import UnknownMethodError, method_spec

    try:
        return {f.name: None for f in dataclasses.fields(method_spec(name).config)}
    except UnknownMethodError:
        return {}  # named by the value check of algo.name


def _known(job: str, defaults: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Every key the job reads: its defaults, plus keys read through other configs (a method's
    dataclass fields under ``algo``; ``run``'s ``bc`` over train.yaml, its overseer over the fleet's)."""
    known = OmegaConf.to_container(OmegaConf.create(defaults))  # a copy
    if "algo" in known:
        names = [v for o in overrides for p, k, v in [_parse(o)] if k == "algo.name"]
        known["algo"] = {**_method_keys(names[-1] if names else known["algo"]["name"]), **known["algo"]}
    if job == "run":
        train = _defaults("train", {})
        train["algo"] = {**_method_keys(train["algo"]["name"]), **train["algo"]}
        known["bc"] = OmegaConf.to_container(OmegaConf.merge(train, known["bc"]))
        names = [v for o in overrides for p, k, v in [_parse(o)] if k == "bc.algo.name"]
        bc_method = names[-1] if names else known["bc"]["algo"].get("name")  # a recipe may pick another method
        known["bc"]["algo"] = {**_method_keys(bc_method), **known["bc"]["algo"]}
        local = OmegaConf.load(str(_configs() / "fleet" / "local.yaml"))
        known["fleet"]["overseer"] = {**OmegaConf.to_container(local.overseer), **known["fleet"]["overseer"]}
    return known


def _free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_FORM)


def _check_keys(overrides: list[str], known: dict[str, Any], groups: Iterable[str]) -> None:
    for override in overrides:
        prefix, key, value = _parse(override)
        if "@" in key or key in groups:
            continue
        if _free_form(key.removeprefix("bc.")):
            # any key goes in these, but one that is not there yet is added with `+` (hydra's
            # own refusal names no setting)
            if not prefix and not _get(known, key)[0]:
                parent, _, name = key.rpartition(".")
                present, node = _get(known, parent)
                keys = ", ".join(sorted(node)) if present and isinstance(node, dict) and node else "none"
                raise ConfigError(key, value, keys, f"{parent} has no setting {name!r} (its settings: {keys}); "
                                  f"+{key}={value} adds one")
            continue
        if "~" in prefix:
            raise ConfigError(key, value, "", f"{override}: deleting a key is not supported; set {key}=VALUE instead")
        node, parts = known, key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                where = "the top level" if i == 0 else ".".join(parts[:i])
                keys = ", ".join(sorted(node)) if isinstance(node, dict) else f"none ({where} is a value)"
                raise ConfigError(key, value, keys, f"unknown key {key!r} in {override!r}; known keys at {where}: {keys}")
            node = node[part]


# --- values ---------------------------------------------------------------------------------
def _get(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_types(reference: dict[str, Any], values: dict[str, Any], rules: dict[str, Check], prefix: str = "") -> None:
    """Each value has its default's type (int, float, bool, list, mapping); keys with a rule,
    free-form dicts and keys without a typed default are skipped."""
    for k, v in values.items():
        key = f"{prefix}{k}"
        if key in rules or _free_form(key.removeprefix("bc.")) or k not in reference:
            continue
        default = reference[k]
        if isinstance(default, dict):
            if v is not None and not isinstance(v, dict):
                raise ConfigError(key, v, "a mapping of settings")
            _check_types(default, v or {}, rules, key + ".")
        elif isinstance(default, bool):
            boolean(key, v)
        elif _is_int(default) and not _is_int(v):
            raise ConfigError(key, v, "an integer")
        elif isinstance(default, float) and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise ConfigError(key, v, "a number")
        elif isinstance(default, list) and v is not None and not isinstance(v, list):
            raise ConfigError(key, v, "a list or null")


def validate(job: str, overrides: list[str], allow_missing: bool = False) -> DictConfig:
    """Compose ``configs/<job>.yaml`` with the CLI ``overrides`` and check it before the job runs
    (``allow_missing``: leave settings the job needs but nobody gave, ``???``, to the job).

    Raises:
        ConfigError: an unknown key, a group choice without its yaml file, a value of the
            wrong type or outside what is allowed, a device this machine does not have.
        hydra.errors.HydraException: an override hydra cannot parse.
    """
    from omegaconf.errors import OmegaConfBaseException

    overrides = expand_overrides(job, overrides)
    defaults = _defaults(job, _choices(job, overrides))
    _check_keys(overrides, _known(job, defaults, overrides), config_groups(job))
    cfg = compose(job, overrides)
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:  # e.g. an interpolation to a key that does not exist
        raise ConfigError(e.full_key, "", "", f"{e.full_key}: {str(e).splitlines()[0]}") from None
    rules = RULES.get(job, {})
    for key, check in rules.items():
        present, value = _get(values, key)
        if present and not (allow_missing and value == MISSING):
            check(key, value)
    _check_types(_known(job, defaults, overrides), values, rules)
    return cfg


# --- help -------------------------------------------------------------------------------------
def job_help(job: str, summary: str, overrides: list[str]) -> str:
    """``robo-post JOB --help [overrides]``: usage, config groups with their choices, and the yaml
    sources (one comment per option) of the job and of the group files the overrides select."""
    overrides = expand_overrides(job, overrides)
    groups, chosen = config_groups(job), _choices(job, overrides)
    lines = [f"usage: robo-post {job} [--help] [--cfg job [--resolve]] [KEY=VALUE | GROUP=CHOICE | +KEY=VALUE ...]",
             "", summary, "",
             "Options are hydra overrides of the settings below; `--cfg job` prints the composed config",
             "without running (also `robo-post config " + job + " [overrides]`)."]
    if groups:
        lines += ["", "config groups (GROUP=CHOICE):"]
        for group, (default, names) in groups.items():
            extra = " | any gymnasium id" if group == "env" else ""
            lines.append(f"  {group:<8} {' | '.join(names)}{extra}   (now: {chosen.get(group, default)})")
    files = [f"{job}.yaml"] + [f"{g}/{chosen.get(g, d)}.yaml" for g, (d, _) in groups.items()]
    for name in files:
        lines += ["", f"# ---- configs/{name}", (_configs() / name).read_text().rstrip()]
    rest = [o for o in overrides if _parse(o)[1] not in chosen]
    if rest:
        lines += ["", "# ---- your overrides (applied over the settings above)", *rest]
    return "\n".join(lines)


def config_yaml(job: str, overrides: list[str], resolve: bool = False) -> str:
    """The composed, checked config of ``job`` as YAML (``--cfg job``); a setting the job needs
    and nobody gave prints as ``???``."""
    return OmegaConf.to_yaml(validate(job, overrides, allow_missing=True), resolve=resolve)
