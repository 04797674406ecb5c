"""`--check` of the models a job reads, on the submit host: hub ids resolved, files opened, tokenizers compared.

`prepare_models(cfg, source)` runs at `mopd-submit --check` and before every submission (launch/check.py,
launch/prepare.py):

1. each model path that is a hub id (launch/hub_cache.py) becomes the snapshot directory of this host's hub
   cache; the returned RunConfig carries it, and so does the run_dir/config.yaml every child reads. An id the
   cache does not hold is refused, with the commands that fetch it;
2. the files of each directory the job reads (the actor's, the tokenizer's, each scored teacher's:
   `ExecutionPlan.teachers`) are checked (launch/model_files.py): a truncated tokenizer, a garbage
   config.json, a truncated safetensors file is refused naming the field and the file;
3. when the files are sound, the compatibility rule the actor applies at start (mopd/compatibility.py: every
   scored teacher shares the actor's tokenizer, the teachers one architecture) is applied here, every
   actor and teacher checkpoint must be of a model family its engine has run
   (`config.capabilities.MODEL_FAMILIES`: dense Qwen3, Qwen3-MoE, Llama; another is refused naming its
   architecture), and a source with `template: chat` needs a tokenizer that holds a chat template.

The jsonl prompt files are read here too (launch/data_check.py): a bad line is refused naming `file:line`.
A directory that does not exist here is not this module's: launch/paths.py warns of it (a Slurm submit; the
path may exist on the cluster alone) or refuses it (a local run). A path not read by this job (a declared
teacher when distillation_coefficient is 0) is resolved when the cache holds it, and never refused.
Every problem is a `config.problems.Problem` on the field (`models.teachers[1].path: ...`), all raised at
once as one `ConfigError`, as the config's own problems are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mopd_hpc.config import ConfigError, RunConfig
from mopd_hpc.config.capabilities import (
    MODEL_FAMILIES,
    MODEL_TYPE_ARCHITECTURES,
    standing,
)
from mopd_hpc.config.problems import Problem
from mopd_hpc.config.serving_refusals import model_family_refusals
from mopd_hpc.launch.data_check import data_problems
from mopd_hpc.launch.hub_cache import (
    HubNotCachedError,
    HubSnapshot,
    cached_snapshot,
    is_hub_id,
    is_local_directory,
)
from mopd_hpc.launch.model_files import directory_problems
from mopd_hpc.launch.moe_check import moe_actor_problems, sync_family_problems
from mopd_hpc.launch.rope_check import rope_problems


@dataclass(frozen=True, slots=True)
class ModelPath:
    """One configured model path: its `field` (`models.teachers[0].path`), the `value` as configured, whether
    this job reads it (`read`), and what it resolved to (`snapshot`, for a hub id the cache holds)."""

    field: str
    value: str
    read: bool
    snapshot: HubSnapshot | None = None


def model_paths(cfg: RunConfig) -> list[ModelPath]:
    """The actor's, the tokenizer's and each teacher's path, in that order; `read` False for the teachers
    the job does not score: all of them when distillation_coefficient is 0 (`ExecutionPlan.from_config`'s
    rule, restated: mopd/ imports torch, which `--check` does not load)."""
    scored = set(cfg.models.teacher_ids) if cfg.loss.distillation_coefficient > 0 else set()
    out = [
        ModelPath("models.actor.path", cfg.models.actor.path, True),
        ModelPath("models.tokenizer.path", cfg.models.tokenizer.path, True),
    ]
    for i, teacher in enumerate(cfg.models.teachers):
        out.append(ModelPath(f"models.teachers[{i}].path", teacher.path, teacher.id in scored))
    return out


def resolve_hub_ids(
    cfg: RunConfig, *, base: Path | None = None, cache_dir: str | Path | None = None
) -> tuple[RunConfig, list[ModelPath], list[Problem]]:
    """Step 1: (cfg with every cached hub id replaced by its snapshot directory, the paths, the problems:
    one per read hub id the cache does not hold)."""
    root = base or Path.cwd()
    paths, problems = [], []
    for mp in model_paths(cfg):
        if is_local_directory(mp.value, root) or not is_hub_id(mp.value):
            paths.append(mp)
            continue
        try:
            snapshot = cached_snapshot(mp.value, cache_dir)
        except HubNotCachedError as exc:
            if mp.read:
                problems.append(Problem(mp.field, f"hub id {mp.value!r} is {exc}"))
            paths.append(mp)
            continue
        paths.append(ModelPath(mp.field, mp.value, mp.read, snapshot))
    return _with_snapshots(cfg, paths), paths, problems


def _with_snapshots(cfg: RunConfig, paths: list[ModelPath]) -> RunConfig:
    if not any(mp.snapshot for mp in paths):
        return cfg
    data = cfg.model_dump(mode="json")
    models = data["models"]
    for mp in paths:
        if mp.snapshot is None:
            continue
        if mp.field == "models.actor.path":
            models["actor"]["path"] = mp.snapshot.path
        elif mp.field == "models.tokenizer.path":
            models["tokenizer"]["path"] = mp.snapshot.path
        else:
            index = int(mp.field.split("[")[1].split("]")[0])
            models["teachers"][index]["path"] = mp.snapshot.path
    return RunConfig.from_dict(data, source="<resolved hub ids>")


def file_problems(cfg: RunConfig, paths: list[ModelPath], base: Path | None = None) -> list[Problem]:
    """Steps 2 and 3 on the directories of `cfg` (hub ids already resolved) that exist here, but a tiny model
    whose first build was interrupted (`local_setup.awaits_build`: `--local` builds it again)."""
    from mopd_hpc.launch.local_setup import awaits_build  # lazily: it imports the trainer's evaluation

    root = base or Path.cwd()
    here = {mp.field: root / Path(_path(cfg, mp.field)).expanduser() for mp in paths if mp.read}
    # a tiny model an interrupted first build left unfinished is not checked: `--local` builds it again
    here = {f: p for f, p in here.items() if p.is_dir() and not awaits_build(cfg, p)}
    problems: list[Problem] = []
    checked: set[tuple[Path, bool]] = set()
    for field, directory in here.items():
        weights = field != "models.tokenizer.path"
        key = (directory.resolve(), weights)
        if key in checked:
            continue
        checked.add(key)
        problems += [
            Problem(field, text) for text in directory_problems(directory, tokenizer=True, weights=weights)
        ]
    problems += architecture_problems(cfg, here)
    problems += chat_template_problems(cfg, here.get("models.tokenizer.path"))
    actor_field, tok_field = "models.actor.path", "models.tokenizer.path"
    teachers = [
        (mp.field, here.get(mp.field)) for mp in paths if mp.field.startswith("models.teachers") and mp.read
    ]
    if problems or actor_field not in here or tok_field not in here or any(d is None for _, d in teachers):
        return problems  # compare tokenizers only when every file they are built from is sound
    from mopd_hpc.mopd.compatibility import CompatibilityError, ModelFiles, compatibility_errors

    actor = ModelFiles("actor", str(here[actor_field]), str(here[tok_field]))
    ids = {f"models.teachers[{i}].path": t.id for i, t in enumerate(cfg.models.teachers)}
    files = [ModelFiles(ids[f], str(d)) for f, d in teachers]
    try:
        errors = compatibility_errors(actor, files)
    except CompatibilityError as exc:
        return [Problem("models", str(exc))]
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on bad files
        return [Problem("models", f"a tokenizer could not be read: {type(exc).__name__}: {exc}")]
    for index, error in errors:
        field = actor_field if index is None else teachers[index][0]
        problems.append(
            Problem(field, str(error), expected="every scored teacher must use the actor's tokenizer")
        )
    return problems


def chat_template_problems(cfg: RunConfig, tokenizer_dir: Path | None) -> list[Problem]:
    """One problem per source with template 'chat' when the tokenizer directory (read here) holds no chat
    template (`data.chat.has_chat_template`): its prompts could not be encoded at the first step."""
    from mopd_hpc.data.chat import has_chat_template

    chat = [i for i, s in enumerate(cfg.data.sources) if s.template == "chat"]
    if not chat or tokenizer_dir is None or has_chat_template(tokenizer_dir):
        return []
    return [
        Problem(
            f"data.sources[{i}].template",
            f"the tokenizer (models.tokenizer.path: {tokenizer_dir}) holds no chat template",
            "chat",
            "template: raw, or a tokenizer whose tokenizer_config.json (or chat_template.jinja) holds one",
        )
        for i in chat
    ]


def _engine(cfg: RunConfig, field: str) -> str | None:
    if field == "models.actor.path":
        return cfg.models.actor.engine
    if field.startswith("models.teachers["):
        return cfg.models.teachers[int(field.split("[")[1].split("]")[0])].engine
    return None


def read_architecture(directory: Path) -> str | None:
    """config.json `architectures[0]` of the checkpoint `directory`; without
    `architectures` the class transformers picks for its model_type (`MODEL_TYPE_ARCHITECTURES`), or
    "model_type '<t>'". None when config.json is unreadable (`directory_problems`' to report)."""
    import json

    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        archs, model_type = hf.get("architectures"), hf.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    arch = archs[0] if archs else MODEL_TYPE_ARCHITECTURES.get(model_type, f"model_type {model_type!r}")
    return str(arch)


def architecture_problems(cfg: RunConfig, here: dict[str, Path]) -> list[Problem]:
    """Each actor or teacher checkpoint (config.json `architectures[0]`, read here) of no declared model family,
    or of one its engine has not run (`config.serving_refusals.model_family_refusals`), naming the architecture.
    An unreadable config.json is `directory_problems`' to report."""
    out = []
    for field, directory in here.items():
        if field == "models.tokenizer.path":
            continue
        arch = read_architecture(directory)
        if arch is not None:
            out += model_family_refusals(field, _engine(cfg, field), arch, str(directory))
            out += rope_problems(field, _engine(cfg, field), directory)
        if arch in MODEL_FAMILIES and field == "models.actor.path":
            out += sync_family_problems(cfg, arch, directory)
        if arch in MODEL_FAMILIES and field == "models.actor.path" and not MODEL_FAMILIES[arch].moe:
            out += dense_actor_problems(cfg, arch)
        elif arch in MODEL_FAMILIES and field == "models.actor.path":
            out += moe_actor_problems(cfg, arch, directory)
    return out


def unverified_model_warnings(cfg: RunConfig, base: Path | None = None) -> list[str]:
    """With `cfg.allow_unverified`: the warning of each checkpoint family its engine has not run on GPUs
    (`architecture_problems`' unverified refusals, which `prepare_models` let through), as --check prints
    them; [] without the opt-in. `cfg` has its hub ids resolved (`prepare_models`)."""
    from mopd_hpc.config.job_gaps import unverified_warning

    if not cfg.allow_unverified:
        return []
    root = base or Path.cwd()
    here = {mp.field: root / Path(_path(cfg, mp.field)).expanduser() for mp in model_paths(cfg) if mp.read}
    here = {f: p for f, p in here.items() if p.is_dir()}
    return [unverified_warning(p) for p in architecture_problems(cfg, here) if p.unverified]


def dense_actor_problems(cfg: RunConfig, arch: str) -> list[Problem]:
    """The settings that act on a mixture-of-experts actor's routers, set for a dense actor of `arch`."""
    out = []
    loss = cfg.loss
    for name, value, off in (
        ("router_aux_loss_coefficient", loss.router_aux_loss_coefficient or 0.0, "null or 0"),
        ("router_z_loss_coefficient", loss.router_z_loss_coefficient, "0"),
    ):
        if value > 0:
            out.append(
                Problem(
                    f"loss.{name}",
                    f"the actor ({cfg.models.actor.path}) is a dense {arch}: it has no router to apply a "
                    "router loss to",
                    value,
                    f"{off}, or a mixture-of-experts actor",
                )
            )
    if cfg.rollout.routing_replay:
        out.append(
            Problem(
                "rollout.routing_replay",
                f"the actor ({cfg.models.actor.path}) is a dense {arch}: it has no routed experts to replay",
                True,
                "false, or a mixture-of-experts actor",
            )
        )
    for name in ("expert_parallel",):
        if getattr(cfg.models.actor, name) > 1:
            out.append(
                Problem(
                    f"models.actor.{name}",
                    f"the actor ({cfg.models.actor.path}) is a dense {arch}: it has no experts to shard",
                    getattr(cfg.models.actor, name),
                    "1",
                )
            )
    return out


def _path(cfg: RunConfig, field: str) -> str:
    if field == "models.actor.path":
        return cfg.models.actor.path
    if field == "models.tokenizer.path":
        return cfg.models.tokenizer.path
    return cfg.models.teachers[int(field.split("[")[1].split("]")[0])].path


def prepare_models(
    cfg: RunConfig,
    source: str = "<config>",
    *,
    base: Path | None = None,
    cache_dir: str | Path | None = None,
    check_files: bool = True,
) -> RunConfig:
    """Steps 1-3 of the module docstring: `cfg` with its hub ids resolved.

    Args:
        source: the config's name, for the error's first line.
        base: the submit directory relative paths are relative to (default: the cwd).
        cache_dir: the hub cache (default: huggingface_hub's, from HF_HUB_CACHE / HF_HOME).
        check_files: False = step 1 only, and an uncached id is left as it is (`--dry-run`, `--probe`: no
            model is loaded).

    Raises:
        ConfigError: every problem, each on its field (an uncached hub id, a damaged file, a teacher with
            another tokenizer).
    """
    resolved, paths, problems = resolve_hub_ids(cfg, base=base, cache_dir=cache_dir)
    if not check_files:
        return resolved
    problems += file_problems(resolved, paths, base) + data_problems(resolved, base)
    if problems := standing(problems, resolved.allow_unverified):  # `unverified_model_warnings` the rest
        raise ConfigError(problems, source)
    return resolved


def resolution_notes(before: RunConfig, after: RunConfig) -> list[str]:
    """One line per hub id `prepare_models` replaced: `models.actor.path: Qwen/Qwen3-0.6B → <snapshot>`."""
    out = []
    for old, new in zip(model_paths(before), model_paths(after), strict=True):
        if old.value != new.value:
            out.append(f"{old.field}: hub id {old.value} is the cached snapshot {new.value}")
    return out
