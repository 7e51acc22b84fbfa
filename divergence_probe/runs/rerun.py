"""What `rerun` replays from a run folder without asking, and the command line it amounts to.

A run folder is data from whoever made it: folders are shared, copied and edited. Most of a recorded spec can only
choose among the tool's own options, but `engine_args` go to `vllm.LLM` as given, and some of vLLM's engine
arguments load or run code: `trust_remote_code` with a model folder whose config has an `auto_map`, a worker or
scheduler class, a plugin, a model loader, hf_overrides, a tokenizer or download path elsewhere, a compile backend
or inductor pass named by its Python path. So rerun replays, without asking, only the engine args that set
numerics, scheduling or compilation and take plain values (numbers, booleans, mode names): the vLLM engine's list
(engines/vllm/replayable.py). Anything else needs `--allow-engine-arg NAME` from the person running rerun.

    check_replayable(spec, allowed=())   # ProbeError naming the first engine arg that needs asking
    command_line(spec)                   # ["divergence-probe", "compare", "--model", ...]
    recorded_score(manifest, where)      # a score run's ScoreSpec and LoadSpec, and its rollout file checked
    recorded_rl(manifest, where)         # an rl run's RLSpec: its engine args, reward and prompt files checked
    RecordedRun(manifest, run_dir, where)  # a compare or ablate run's spec, and its prompt and model checks
    recorded_gate(manifest, kind, added, where)  # the --fail-if gate the run recorded, and any added to it

A score run replays no engine args at all: the score command takes none, so a manifest that holds some was edited.
An rl run's reward plug-in (`--reward module:function`) is code to import, so rerun replays the built-in rewards
alone.

A run made with `--fail-if` recorded its gate (manifest.json `gate.fail_if`); rerun judges the new run by it, with
the same exit code (1 when a condition holds), so a CI job that reruns a failed run fails again. Conditions given to
rerun's own `--fail-if` are added to the recorded ones.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Iterable

from ..engines import stack_class
from ..errors import ProbeError, printable
from ..spec.run import COMPONENTS, RunSpec, flat_fields
from ..spec.load import DEFAULT_INFER, LoadSpec
from ..spec.fields import flag_of
from ..spec.from_manifest import recorded

ALLOW_FLAG = "--allow-engine-arg"

def check_replayable(spec: RunSpec, allowed: Iterable[str], where: str) -> None:
    """ProbeError, one line naming the manifest field and the flag that allows it, for the first engine arg of
    `spec` that rerun does not replay without asking."""
    _check_engine_args(spec.load.engine_args, spec.load.infer, "spec.load.engine_args", allowed, where)


def _check_engine_args(engine_args: dict, infer: str, field: str, allowed: Iterable[str], where: str) -> None:
    """`infer`: the registry name of the stack the args go to, which says which of them it replays."""
    refused = stack_class(infer).refused_replay(engine_args, tuple(allowed))
    if refused:
        more = f" (and {', '.join(refused[1:])})" if len(refused) > 1 else ""
        raise ProbeError(f"{where} sets {field}.{refused[0]}{more}, which rerun does not replay without "
                         "asking: it can load or run code, or is not one of the numerics, scheduling and compile "
                         f"settings rerun replays; if you trust whoever made the run folder, pass "
                         + " ".join(f"{ALLOW_FLAG} {name}" for name in refused))


def _flag_value(value) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _flag_words(f, value) -> list[str]:
    """One field's value as command-line words: a bool as --flag / --no-flag, anything else as the flag and its value."""
    flag = flag_of(f)
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, _flag_value(value)]


def recorded_gate(manifest: dict, kind: str, added, where: str, replay: bool = True):
    """The gate a rerun judges (a reports.gate.Gate, or None when there is none): the conditions the run recorded
    (gate.fail_if), each checked as --fail-if checks it (the manifest is data: one line naming the field), then
    those of rerun's --fail-if, each once. `replay` False (--no-recorded-gate): rerun's own alone, the way out of a
    recorded gate that is now refused (one an older version accepted, or an edited one)."""
    from ..reports.gate import WITHOUT_RECORDED, Gate

    section = manifest.get("gate") if replay else None
    texts = [] if section is None else section.get("fail_if") if isinstance(section, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ProbeError(f"{where}: gate.fail_if is not a list of conditions (METRIC OP VALUE); restore the manifest, "
                         f"re-run its `command`, or {WITHOUT_RECORDED}")
    try:
        Gate.parse(texts, kind)
    except ProbeError as e:
        raise ProbeError(f"{where} records a gate rerun cannot judge (gate.fail_if): {e}; {WITHOUT_RECORDED}") \
            from None
    both = list(dict.fromkeys([*texts, *(added or ())]))
    return Gate(Gate.parse(both, kind).conditions, kind, recorded=tuple(texts)) if both else None


def _gate_words(gate) -> list[str]:
    return [word for c in (gate.conditions if gate else ()) for word in ("--fail-if", c.text)]


def command_line(spec: RunSpec, out_dir=None, gate=None) -> list[str]:
    """The compare/ablate command line that makes the same run as `spec` (the flags that differ from their
    defaults), for a person to read before rerun runs it."""
    argv = ["divergence-probe", spec.kind]
    for component, f, _name in flat_fields(spec.kind):
        if component is None:  # --report: rerun's own flag
            continue
        default_owner = COMPONENTS[component]()
        value, default = getattr(getattr(spec, component), f.name), getattr(default_owner, f.name)
        if value == default or value is None:
            continue
        argv += _flag_words(f, value)
    argv += _gate_words(gate)
    if out_dir is not None:
        argv += ["--out", str(out_dir)]
    return argv


def describe(spec: RunSpec, out_dir, gate=None) -> list[str]:
    """What rerun is about to run, in lines for the console: the model, the prompts, the engine args, the command."""
    load = spec.load
    lines = [f"rerun: {spec.kind} of model {load.model or 'builtin:default'} ({load.infer} vs {load.train}, "
             f"{load.dtype} on {load.device}, engine {load.engine if stack_class(load.infer).modes else 'none'})",
             f"  prompts: {spec.prompts.prompts or 'the packaged sample prompts'}",
             f"  engine args: {json.dumps(load.engine_args, sort_keys=True) if load.engine_args else 'none'}",
             f"  same as: {shlex.join(command_line(spec, out_dir, gate))}"]
    return [printable(line) for line in lines]  # the manifest's strings are data: shown escaped


def recorded_score(manifest: dict, where: str):
    """(ScoreSpec, LoadSpec, sha256) that re-make the score run of `manifest`, each field checked as its flag is; the
    rollout file it names must be a regular file (a pipe or a device is refused in one line) with the recorded
    sha256, and score_spec checks the bytes it reads against it again (a file swapped in between is caught)."""
    from ..rundir import file_sha256
    from ..spec.score import ScoreSpec

    section = manifest.get("score")
    if not isinstance(section, dict) or "spec" not in section or "load_spec" not in section:
        raise ProbeError(f"{where} lacks the recorded score spec (score.spec, score.load_spec): the run was made "
                         "before score runs recorded it; re-run its `command` instead")
    call = recorded(ScoreSpec, section["spec"], "score.spec")
    load = recorded(LoadSpec, section["load_spec"], "score.load_spec")
    if load.engine_args:
        raise ProbeError(f"{where} sets score.load_spec.engine_args, which the score command never records (it takes "
                         "no engine args): the manifest was edited; restore it or re-run its `command`")
    path = Path(call.rollouts)
    if not path.is_file():
        raise ProbeError(f"the rollout file {path} that {where} names is missing or not a regular file; restore it "
                         "there, or score it again with `divergence-probe score`")
    want = section.get("rollouts_sha256")
    try:
        have = file_sha256(path)  # before the preview, so a stale file is refused at once; score_spec checks again
    except OSError as e:
        raise ProbeError(f"the rollout file {path} that {where} names cannot be read ({e.strerror}); make it readable, "
                         "or score it again with `divergence-probe score`") from None
    if not isinstance(want, str) or have != want:
        raise ProbeError(f"the rollout file {path} changed since the run was made (its sha256 is not the one {where} "
                         "records); restore it, or score it again with `divergence-probe score`")
    return call, load, want


def recorded_rl(manifest: dict, where: str, allowed: Iterable[str] = ()):
    """The RLSpec that re-makes the rl run of `manifest`, each field checked as its flag is, its engine args as
    compare's are (check_replayable); a reward plug-in (module:function: code to import) is refused, and a prompt
    file must have the sha256 the run recorded."""
    from ..prompts import file_hashes
    from ..rl_choices import BUILT_IN_REWARDS
    from ..spec.rl import RLSpec, regrouped

    if "spec" not in manifest:
        raise ProbeError(f"{where} lacks the recorded rl spec: the run was made before rl runs recorded it; re-run its "
                         "`command` instead")
    spec = recorded(RLSpec, regrouped(manifest["spec"]), "spec")
    _check_engine_args(spec.load.engine_args, DEFAULT_INFER, "spec.load.engine_args", allowed, where)
    if spec.reward is not None and spec.reward not in BUILT_IN_REWARDS:
        raise ProbeError(f"{where} sets spec.reward to the plug-in {spec.reward!r}, Python code rerun does not import "
                         "from a run folder; if you trust whoever made it, run "
                         f"`{shlex.join(rl_command_line(spec))}` yourself")
    if spec.prompts.prompts is not None:
        path = spec.prompts.path
        if path.exists() and not (path.is_dir() or path.is_file()):
            raise ProbeError(f"{where}: spec.prompts.prompts {path} is not a file or folder (a pipe or device would "
                             "block or never end); point it at the prompt files the run used")
        section = manifest.get("rl")
        want = section.get("prompt_files_sha256") if isinstance(section, dict) else None
        if not isinstance(want, dict):
            raise ProbeError(f"{where} lacks the prompt hashes a rerun checks (rl.prompt_files_sha256); re-run its "
                             "`command` instead")
        if file_hashes(path) != want:
            raise ProbeError(f"the prompt files under {path} changed since the run was made (their sha256 are not "
                             f"those {where} records); restore them")
    return spec


def recorded_rl_run(run_dir: Path, where: str, allowed: Iterable[str] = ()):
    """(manifest, RLSpec) of an rl run folder: a finished, unchanged run (its rows match the manifest's sha256) whose
    recorded spec passes recorded_rl's checks."""
    from ..reports.rl_rows import read_rows
    from ..run_folder import read_manifest

    read_rows(run_dir)  # refuses a run that did not finish and a changed rl.csv
    manifest = read_manifest(run_dir)
    if manifest.get("kind") != "rl":
        raise ProbeError(f"{where} is not an rl run's manifest (kind {manifest.get('kind')!r}) although the "
                         "folder holds rl.csv; pass the --out folder of an rl run")
    return manifest, recorded_rl(manifest, where, allowed)


def same_model(manifest: dict, source, run_dir: Path, command: str) -> None:
    """rerun re-makes a run only on the checkpoint it was made with: the model's config.json has the recorded
    sha256."""
    model = manifest.get("model")
    want = model.get("config_sha256") if isinstance(model, dict) else None
    if not isinstance(want, str):
        raise ProbeError(f"{run_dir}/manifest.json lacks the model hash a rerun checks; re-run its `command` instead")
    have = source.config_sha256
    if want != have:
        raise ProbeError(f"the model's config.json changed since {run_dir} was made (sha256 {have[:12]}… "
                         f"vs {want[:12]}…); point --model of a new {command} at the original checkpoint")


@dataclass
class RecordedRun:
    """A compare or ablate run folder to run again: the spec its manifest recorded, and the checks that the prompt
    files and the model are the ones the run read (before the model loads, and on the bytes the run read)."""

    manifest: dict
    run_dir: Path
    where: str
    spec: RunSpec | None = None

    def read_spec(self, report: bool, allowed: Iterable[str]) -> RunSpec:
        """The recorded RunSpec (with `report`), every field checked as its flag is and its engine args as
        check_replayable checks them."""
        if "spec" not in self.manifest:
            raise ProbeError(f"{self.run_dir} was written before runs recorded their spec; re-run its `command` "
                             "from manifest.json instead")
        try:
            spec = replace(RunSpec.from_dict(self.manifest["spec"]), report=report)
        except ProbeError as e:
            raise ProbeError(f"{self.where}: {e}") from None
        check_replayable(spec, allowed, self.where)
        prompts = spec.prompts.path
        if prompts.exists() and not (prompts.is_dir() or prompts.is_file()):
            raise ProbeError(f"{self.where}: spec.prompts.prompts {prompts} is not a file or folder (a pipe or device "
                             "would block or never end); point it at the prompt files the run used")
        self.spec = spec
        return spec

    def check(self, source) -> None:
        """Before anything loads (fails in seconds): the prompt files this rerun reads, found as the run found
        them, and the model's config have the recorded sha256."""
        from ..prompts import file_hashes

        self._same_prompts(file_hashes(self.spec.prompts.path))
        same_model(self.manifest, source, self.run_dir, "compare")

    def check_run(self, made: dict) -> None:
        """The hashes of the bytes the run read: a file swapped since `check` is caught."""
        self._same_prompts(made["compare"]["prompt_files_sha256"])

    def _same_prompts(self, hashes: dict) -> None:
        compared = self.manifest.get("compare")
        recorded_prompts = compared.get("prompt_files_sha256") if isinstance(compared, dict) else None
        if not isinstance(recorded_prompts, dict):
            raise ProbeError(f"{self.run_dir}/manifest.json lacks the model or prompt hashes a rerun checks; re-run "
                             "its `command` instead")
        if hashes != recorded_prompts:
            raise ProbeError(f"the prompt files under {self.spec.prompts.path} changed since {self.run_dir} was "
                             "made; restore them")


def describe_rl(spec, out_dir) -> list[str]:
    """What rerun is about to run for an rl run folder, in lines for the console."""
    argv = rl_command_line(spec) + (["--out", str(out_dir)] if out_dir is not None else [])
    load = spec.load
    return [f"rerun: rl of model {load.model or 'builtin:default'} ({len(spec.settings)} setting(s) x "
            f"{spec.seeds} seed(s), {spec.steps} steps, engine {load.engine}, on {load.device})",
            f"  engine args: {json.dumps(load.engine_args, sort_keys=True) if load.engine_args else 'none'}",
            f"  same as: {shlex.join(argv)}"]


def rl_command_line(spec) -> list[str]:
    """The rl command line of an RLSpec: the flags that differ from their defaults (a tuple: the flag repeated, as
    --setting is given)."""
    plain, values = type(spec)().options(), spec.options()
    argv = ["divergence-probe", "rl"]
    for f in spec.option_fields():
        value = values[f.name]
        if value == plain[f.name]:
            continue
        for item in value if isinstance(value, tuple) else (value,):
            argv += _flag_words(f, item)
    return argv


def score_command_line(call, load: LoadSpec, out_dir=None, gate=None) -> list[str]:
    """The score command line that makes the same run as (call, load), for a person to read before rerun runs it;
    the trainer settings score has no flag for (set through the Python API) follow as `name=value` words."""
    argv = ["divergence-probe", "score", call.rollouts]
    defaults = type(call)(rollouts=call.rollouts)
    for f in fields(call):
        value = getattr(call, f.name)
        if f.name != "rollouts" and value != getattr(defaults, f.name):
            argv += [flag_of(f), str(value)]
    flags = ("model", "dtype", "device", "train_attn", "train_sdpa")  # score's own trainer flags
    plain = LoadSpec()
    for f in fields(load):
        value = getattr(load, f.name)
        if f.name != "infer" and value != getattr(plain, f.name):
            argv += [flag_of(f), str(value)] if f.name in flags else [f"{f.name}={_flag_value(value)}"]
    argv += _gate_words(gate)
    if out_dir is not None:
        argv += ["--out", str(out_dir)]
    return argv


def describe_score(call, load: LoadSpec, out_dir, gate=None) -> list[str]:
    """What rerun is about to run for a score run folder, in lines for the console."""
    lines = [f"rerun: score of {call.rollouts} with model {load.model or 'builtin:default'} (trainer {load.train}, "
             f"{load.dtype} on {load.device}" + (", engine prefill vllm)" if call.infer else ")"),
             f"  same as: {shlex.join(score_command_line(call, load, out_dir, gate))}"]
    return [printable(line) for line in lines]  # the manifest's strings are data: shown escaped


__all__ = ["ALLOW_FLAG", "check_replayable", "command_line", "describe", "describe_rl", "describe_score",
           "recorded_gate", "recorded_rl", "recorded_score", "rl_command_line", "score_command_line"]
