"""Composing every job of a run or sweep the way Hydra will, before Hydra runs any of them, so that
pre-flight can check each one; and turning Hydra's composition errors into one readable line.

A sweep is expanded here with Hydra's own override parser (the basic sweeper's cartesian product).
Other sweepers (Optuna, ...) choose their jobs as they go: pre-flight then checks the first job, with
each swept key at a representative value (the first choice, the start of an interval), and every job
is checked again when it starts.
"""

from __future__ import annotations

import importlib.resources
import itertools
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .errors import UserError

CONFIG_NAME = "config"
Compose = Callable[[list[str]], DictConfig]
# Sections other tools name settings in, by their first key: where ddpexp keeps that setting. Not
# aliases (one setting, one name, in every sweep and report): the error points to ddpexp's key.
ELSEWHERE = {
    "ac": "trainer.activation_checkpointing=none|full|selective",  # torchtitan's --ac.mode
    "activation_checkpoint": "trainer.activation_checkpointing=none|full|selective",  # torchtitan
}


def conf_dir() -> str:
    return str(importlib.resources.files("ddpexp.conf"))


def profile_names(folder: str) -> list[str]:
    """The profiles of conf/<folder> (interconnect, cluster): YAML files that are not config groups."""
    return sorted(p.stem for p in (Path(conf_dir()) / folder).glob("*.yaml"))


def profile_file(folder: str, name: str, *, setting: str, what: str) -> Path:
    """conf/<folder>/<name>.yaml, or a YAML file of the user's given by its path; anything else is one
    line listing the choices."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else Path(conf_dir()) / folder / f"{name}.yaml"
    if not path.is_file():
        raise UserError(
            f"no {what} {name!r}",
            setting=setting,
            fix=f"one of {', '.join(profile_names(folder))} (conf/{folder}/), or a YAML file's path",
        )
    return path


def search_path_override(config_dir: str | None) -> list[str]:
    """`--config-dir DIR`: the user's folder joins the config search path (after ddpexp's own)."""
    if not config_dir:
        return []
    path = Path(config_dir).resolve()
    if not path.is_dir():
        raise UserError(f"{path} is not a directory", setting="--config-dir", fix="give an existing folder")
    return [f"hydra.searchpath=[file://{path}]"]


def register_schema() -> None:
    """Make the schema available to conf/config.yaml's defaults list as `config_schema`, and every
    built-in strategy's own schema as `<name>_schema` (importing a strategy module registers it)."""
    from hydra.core.config_store import ConfigStore

    from . import strategies
    from .config import Config

    ConfigStore.instance().store(name="config_schema", node=Config)
    strategies.load_builtins()


@contextmanager
def composer(config_name: str = CONFIG_NAME) -> Iterator[Compose]:
    """Hydra's compose API on ddpexp's config tree; composition errors become one-line UserErrors."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3", job_name="ddpexp"):

            def compose_one(overrides: list[str]) -> DictConfig:
                if config_name == CONFIG_NAME:
                    _refuse_benchmark_keys(overrides)
                try:
                    return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
                except Exception as exc:  # Hydra/OmegaConf composition errors: one line naming the key
                    if _yaml_error(exc) is not None:
                        raise UserError(one_line(exc), fix=YAML_FIX) from exc
                    raise _bad_config_file(exc, overrides) or UserError(one_line(exc), fix=_fix(exc)) from exc

            yield compose_one
    finally:
        GlobalHydra.instance().clear()


def expand(
    overrides: list[str], *, multirun: bool, compose: Compose
) -> tuple[list[str], list[list[str]], set[str]]:
    """(the overrides to run with, the override list of every job to check before launch, the keys
    that take more than one value). Basic sweeper: every job; other sweepers: the first, at
    representative values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = _parse(parser, overrides)
    _refuse_unknown_additions(parsed)
    if not multirun:
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        if sweeps:
            raise UserError(f"{sweeps[0]} lists several values", fix="add -m to run a sweep")
        return overrides, [overrides], set()
    overrides = _into_swept_groups(parsed, _swept_groups(parsed))
    parsed = _parse(parser, overrides)
    # Hydra composes the sweep's base config from the non-swept overrides alone, before any job; the
    # sweep parameters set there (hydra.sweeper.params, e.g. by an experiment preset) join the command
    # line's.
    fixed = [o.input_line or "" for o in parsed if not o.is_sweep_override()]
    try:
        base = compose(fixed)
    except UserError as exc:
        if _yaml_error(exc) is not None:  # a broken file, whatever the overrides
            raise
        raise UserError(
            f"{exc.message} (Hydra applies it before choosing the swept options)",
            fix=(f"{exc.fix}; " if exc.fix else "")
            + "for a key inside a config group a preset sweeps, write ++key=value (e.g. ++data.root=...)",
        ) from exc
    params = base.hydra.sweeper.get("params") or {}
    basic = str(base.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper")
    combined = _last_per_key(_parse(parser, [f"{k}={v}" for k, v in params.items()] + overrides))
    if basic and any(o.key_or_group == "repeat" and o.is_sweep_override() for o in combined):
        # trainer.repeats: the basic sweeper's product varies its first sweep slowest, so `repeat`
        # goes first (a stable sort) and every job runs once per round, in turn; a preset's sweep
        # (which Hydra puts before the command line's) moves onto the command line behind it.
        combined = sorted(combined, key=lambda o: o.key_or_group != "repeat")
        overrides = (["hydra.sweeper.params=null"] if params else []) + [o.input_line or "" for o in combined]
    combined = _parse(parser, _into_swept_groups(combined, _swept_groups(combined)))
    varying = {o.key_or_group for o in combined if o.is_sweep_override()}
    choices = [_values(o, every=basic) for o in combined]
    return overrides, [list(job) for job in itertools.product(*choices)], varying


def _last_per_key(parsed: list[Any]) -> list[Any]:
    """One override per key, as Hydra's basic sweeper keeps them: the last one given (the command
    line's over a preset's sweep), in the first one's place."""
    last = {o.get_key_element(): o for o in parsed}
    return list(last.values())


def _refuse_unknown_additions(parsed: list[Any]) -> None:
    """`+key=value` / `++key=value` may add keys to the open sections (model, data, task: arguments of
    your own build functions) but not to the schema's typed sections, where Hydra would accept and
    nobody would read it (`+trainer.fast_dev_run=true`)."""
    import dataclasses
    import difflib
    import typing

    from .config import Config

    open_sections = {"model", "data", "task", "strategy", "hydra"}  # strategy: its own schema decides
    for o in parsed:
        if not (o.is_add() or o.is_force_add()) or o.key_or_group.split(".", 1)[0] in open_sections:
            continue
        if "@" in o.key_or_group or "/" in o.key_or_group:
            continue  # a config group added under a package: Hydra's own business
        schema: Any = Config
        path: list[str] = []
        for part in o.key_or_group.split("."):
            known = {f.name: f for f in dataclasses.fields(schema)}
            if part not in known:
                where = ".".join(path) or "the top level"
                close = difflib.get_close_matches(part, list(known), n=1, cutoff=0.6)
                hint = f"did you mean {'.'.join([*path, close[0]])}?" if close else "python -m ddpexp --help"
                if not path and part in ELSEWHERE:
                    hint = f"use {ELSEWHERE[part]}"
                raise UserError(
                    f"{o.input_line}: {part!r} is not a setting of {where} ({schema.__name__}); "
                    "+ cannot add one there",
                    fix=hint + " (keys of model, data and task may be added with +)",
                )
            path.append(part)
            field_type = typing.get_type_hints(schema).get(part)
            if not dataclasses.is_dataclass(field_type):
                break
            schema = field_type


def _swept_groups(parsed: list[Any]) -> set[str]:
    """Config groups whose option the sweep varies (strategy=single,ddp sweeps the `strategy` group)."""
    return {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}


def _into_swept_groups(parsed: list[Any], groups: set[str]) -> list[str]:
    """A fixed setting inside a swept group (strategy.bucket_cap_mb=1 with strategy=naive_allreduce,ddp)
    is meant for every job. Hydra applies fixed settings to its base config first, whose option (the
    default one) may not have the key; `++` sets it there too, and each job's own schema still decides
    whether the key is allowed (pre-flight refuses the jobs whose strategy does not have it)."""
    out = []
    for o in parsed:
        line = o.input_line or ""
        group = o.key_or_group.split(".", 1)[0]
        inside = "." in o.key_or_group and group in groups
        if inside and not o.is_sweep_override() and not line.startswith(("+", "~")):
            line = "++" + line
        out.append(line)
    return out


def _parse(parser: Any, overrides: list[str]) -> list[Any]:
    from hydra.errors import OverrideParseException

    try:
        return list(parser.parse_overrides(overrides))
    except OverrideParseException as exc:
        key, _, value = exc.override.partition("=")
        raise UserError(
            one_line(exc), fix=f"quote a value with special characters: '{key}=\"{value}\"'"
        ) from exc
    except Exception as exc:
        raise UserError(one_line(exc)) from exc


def _values(override: Any, *, every: bool) -> list[str]:
    """`key=value` strings for one override: each value of a discrete sweep (or only the first, for
    a sweeper that picks values itself), the start of an interval."""
    if not override.is_sweep_override():
        return [override.input_line or ""]
    key = override.get_key_element()
    if override.is_discrete_sweep():
        values = list(override.sweep_string_iterator())
        return [f"{key}={v}" for v in (values if every else values[:1])]
    if every:
        raise UserError(
            f"{override.input_line}: the basic sweeper cannot sweep an interval",
            fix="list the values (a,b,c) or range(...), or choose a sweeper that samples, "
            "e.g. hydra/sweeper=optuna",
        )
    return [f"{key}={override.value().start}"]  # an interval: any value in it composes the same


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


YAML_FIX = "correct the YAML at that line; usual causes: an unclosed bracket or quote, a tab, indentation"
# Hydra's words for a config file holding a list or a value: the option, and what it holds.
_NOT_A_MAPPING = re.compile(
    "In '([^']+)': ValidationError raised while composing config: "
    + r"Invalid type assigned: (\w+) is not a subclass of Dict"
)


def _search_dirs(overrides: list[str]) -> list[Path]:
    """Where Hydra looks for config files: ddpexp's conf/ and the folders --config-dir added."""
    added = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.searchpath=")]
    folders = [f.strip() for a in added for f in a.strip("[]").split(",")]
    return [Path(conf_dir()), *(Path(f.removeprefix("file://")) for f in folders if f.startswith("file://"))]


def _bad_config_file(exc: BaseException, overrides: list[str]) -> UserError | None:
    """A config file Hydra could not use, named: one that is not UTF-8 text (Hydra's error names no
    file), or one that holds a list or a value where a config (key: value lines) belongs."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, UnicodeDecodeError):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, UnicodeDecodeError):
        for path in sorted(p for d in _search_dirs(overrides) for p in d.rglob("*.yaml")):
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError as bad:
                return UserError(
                    f"{path} is not UTF-8 text (byte {bad.object[bad.start]:#04x} at offset {bad.start})",
                    setting="--config-dir",
                    fix="save the file as UTF-8 (your editor's encoding setting, or iconv -t utf-8)",
                )
        return None
    found = _NOT_A_MAPPING.search(" ".join(str(exc).split()))
    if found is None:
        return None
    option, kind = found.groups()
    files = [d / f"{option}.yaml" for d in reversed(_search_dirs(overrides))]
    where = next((str(f) for f in files if f.is_file()), f"{option}.yaml")
    return UserError(
        f"{where} holds a YAML {kind} where a config belongs",
        setting=option.split("/")[0],
        fix="write it as key: value lines (a mapping), as the files in ddpexp's conf/ are",
    )


def _yaml_error(exc: BaseException) -> Any:
    """The YAML syntax error (with its file, line and column) behind a composition error, if any."""
    from yaml import MarkedYAMLError

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, MarkedYAMLError):
        seen = seen.__cause__ or seen.__context__
    return seen if seen is not None and seen.problem_mark is not None else None


def one_line(exc: BaseException) -> str:
    """Hydra's message, with the precise reason OmegaConf gave underneath it, on one line."""
    from hydra.errors import OverrideParseException

    syntax = _yaml_error(exc)
    if syntax is not None:  # line and column counted from 1, as editors do
        mark, began = syntax.problem_mark, syntax.context_mark
        context = f" ({syntax.context}" if syntax.context else ""
        if context and began is not None and began.name == mark.name:
            context += f" at line {began.line + 1}, column {began.column + 1}"
        context += ")" if context else ""
        problem = syntax.problem or type(syntax).__name__
        return (
            f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}{context}"
        )
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    options = [ln for ln in lines if ln.startswith("Available options")]
    if "Could not find" in head and options:
        idx = lines.index(options[0])
        names = [ln for ln in lines[idx + 1 :] if " " not in ln and ":" not in ln and "_schema" not in ln]
        return f"{head.split(': ', 1)[-1]}; options: {', '.join(names)} (python -m ddpexp --help lists them)"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override {exc.override!r}: {head}"
    cause = exc.__cause__
    detail = [ln.strip() for ln in str(cause).splitlines() if ln.strip()] if cause is not None else []
    full_key = next(
        (ln.split(":", 1)[1].strip() for ln in lines + detail if ln.startswith("full_key:")), None
    )
    if detail and detail[0] not in head:
        head = f"{head.rstrip('.')}: {detail[0]}"
    return f"{full_key}: {head}" if full_key and full_key not in head else head


def _refuse_benchmark_keys(overrides: list[str]) -> None:
    """The training config leaves `commbench` null, where Hydra's own error is an assertion."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.partition(".")[0] == "commbench":
            raise UserError(
                "is a setting of the collective benchmark, not of training",
                setting=key,
                fix=f"python -m ddpexp.commbench {override.lstrip('+~')}",
            )


def _fix(exc: BaseException) -> str | None:
    """For a key the schema does not have: the strategies that own it, or the closest real key."""
    import dataclasses
    import difflib

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from . import strategies

    cause = exc.__cause__
    if not isinstance(cause, ConfigAttributeError | ConfigKeyError) or cause.key is None:
        return None
    key, full_key = str(cause.key), str(cause.full_key)
    if full_key.split(".")[0] in ELSEWHERE:  # a top-level key: Hydra's ConfigKeyError
        return f"use {ELSEWHERE[full_key.split('.')[0]]}"
    if not isinstance(cause, ConfigAttributeError):
        return None
    if full_key.startswith("strategy."):
        return strategies.setting_hint(key)
    schema = cause.object_type
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        return None
    parent = full_key.rpartition(".")[0]
    return f"did you mean {parent + '.' if parent else ''}{close[0]}?"


def remote_host(cfg: DictConfig) -> Any:
    """Jobs that a launcher plugin runs elsewhere (Slurm) are checked against that machine's declared
    GPUs, not this one's: a login node without GPUs must not veto a GPU job. Their own host re-checks
    everything before starting. One Slurm node and one task per job: ddpexp spawns the workers there."""
    from .plan import HostFacts

    launcher = cfg.hydra.launcher
    target = str(launcher.get("_target_", "BasicLauncher"))
    if "BasicLauncher" in target:
        return None
    for key in ("nodes", "tasks_per_node"):
        if launcher.get(key, 1) != 1:
            raise UserError(
                f"is {launcher.get(key)}; ddpexp runs one launcher task per node and starts one worker "
                "per GPU itself",
                setting=f"hydra.launcher.{key}",
                fix=f"set hydra.launcher.{key}=1; for several nodes run torchrun inside sbatch (README)",
            )
    if "SlurmLauncher" in target and shutil.which("sbatch") is None:
        raise UserError(
            "submits jobs to Slurm, but this machine has no Slurm (sbatch is not on PATH)",
            setting="hydra/launcher=slurm",
            fix="run it on a Slurm login node, or use hydra/launcher=submitit_local to try it here",
        )
    return HostFacts(cuda_devices=launcher.get("gpus_per_node") or 0, nccl=True, gloo=True, mpi=True)
