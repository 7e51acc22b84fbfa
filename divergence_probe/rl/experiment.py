"""An rl experiment: every (setting, seed) run of a spec on one engine, its rows written as they are made, and the
run folder saved or rescued whatever happens (rl/table.py writes it)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from ..errors import OutputError, StackError
from ..prompts import file_hashes, read_prompt_sources
from ..rundir import MANIFEST
from ..runs.manifest import build_manifest, runnable_command
from .loop import Loop, load, load_spec
from .reward import load_reward
from ..spec.rl import RLSpec
from ..numerics.rl_summary import summarize
from .table import ROWS, SUMMARY, rescue, rl_folder

Progress = Callable[[dict, int, int], None]  # (row, rows done, rows in all)


@dataclass
class RLResult:
    spec: RLSpec
    rows: pd.DataFrame
    summary: pd.DataFrame
    manifest: dict
    out_dir: Path


def run(spec: RLSpec, out_dir: str | Path, progress: Progress | None = None, probe=None,
        check: Callable | None = None, recorded: Callable[[], dict] | None = None) -> RLResult:
    """Every (setting, seed) run of `spec` on one engine; rows go to OUT/rl.csv as they are made.
    `probe`: an already loaded rl probe (`rl.loop.load(spec)`); default: load one, calling `check(source)` before
    either stack loads (rl.loop.load). `recorded()`: fields the caller adds to the manifest, asked for once the last
    step is done (the CLI: the seconds of each phase)."""
    out_dir = Path(out_dir)
    load_reward(spec.reward)  # a bad plug-in, prompt file or engine arg fails in seconds, before the engine starts
    prompt_hashes = {}  # what rerun checks before it replays the run on prompt files of the user's
    if spec.prompts.prompts is not None:
        read_prompt_sources(spec.prompts.path)
        prompt_hashes = {"prompt_files_sha256": file_hashes(spec.prompts.path)}
    if probe is None and spec.load.engine_args:
        from ..engines import capabilities_of, stack_class

        settings = load_spec(spec)
        stack_class(settings.infer).check_settings(settings, imports=True)  # imports vLLM, starts nothing
        refusal = capabilities_of(settings.infer, engine=settings.engine, ranks=settings.engine_ranks
                                  ).first_refused(["rl"])
        if refusal:  # an engine over several processes, whose weights rl cannot push
            raise StackError(refusal)
    with ExitStack() as claim:
        try:
            writer = claim.enter_context(rl_folder(out_dir))
        except OSError as e:  # the folder could not be made or marked (a full disk): none is left behind
            raise OutputError(f"cannot write {out_dir} ({e.strerror or e}); free space there or choose another "
                              "--out") from e
        probe = probe or load(spec, check)
        loop = Loop(probe, spec)
        claim.callback(loop.close)
        rows: list[dict] = []
        total = len(spec.settings) * len(spec.seed_list) * spec.steps

        def keep(row: dict) -> None:
            with _writing(ROWS):
                writer.add(row)
            rows.append(row)
            if progress is not None:
                progress(row, len(rows), total)

        finished = None
        try:
            for seed in spec.seed_list:  # seed by seed: a stopped experiment keeps whole comparisons of the settings
                for setting in spec.settings:
                    loop.run(setting, seed, keep)
            table = pd.DataFrame(rows)
            summary = summarize(table)
            manifest = build_manifest("rl", probe.manifest(), {
                        "rl": {"engine_args": dict(probe.config.engine_args), "settings": list(spec.settings),
                               "seeds": list(spec.seed_list), "trainer": "FP32 master weights, AdamW (0.9, 0.95), "
                               "BF16 compute model; BF16 weights pushed", **prompt_hashes},
                        **(recorded() if recorded is not None else {})}, spec=spec.to_dict(), command=runnable_command())
            finished = (manifest, summary)
            with _writing(f"{SUMMARY} or {MANIFEST}"):
                writer.finish(manifest, summary)
        except _WriteFailed as e:
            raise _saved_elsewhere(out_dir, writer, rows, finished, e) from e.__cause__
    return RLResult(spec, table, summary, manifest, out_dir)


class _WriteFailed(Exception):
    """An OSError writing the run folder (not one from the engine or a plug-in), with the file it was writing."""

    def __init__(self, name: str, error: OSError) -> None:
        super().__init__(name)
        self.name, self.error = name, error


@contextmanager
def _writing(name: str):
    try:
        yield
    except OSError as e:
        raise _WriteFailed(name, e) from e


def _saved_elsewhere(out_dir: Path, writer, rows: list[dict], finished, failed: _WriteFailed) -> OutputError:
    """The one-line error of a run whose folder could not be written; its rows go to a rescue folder (as compare's
    results do) and --out is left as it was before the run, or, when nothing could be saved, with what it got."""
    problem = failed.error.strerror or str(failed.error)
    saved = ""
    if rows:
        where, why = rescue(out_dir, rows, finished)
        if where is not None:
            writer.discard()
            what = "the results were" if finished else f"the {len(rows)} steps done were"
            saved = f"; {what} saved to {where} instead (move that folder where you want it)"
        else:
            saved = f"; the {len(rows)} steps done could not be saved elsewhere either ({why}), {ROWS} keeps those " \
                    "that reached the disk"
    stopped = "" if finished else " and the run stopped"
    return OutputError(f"cannot write {failed.name} in {out_dir} ({problem}){stopped}{saved}; free space there or "
                       "choose another --out and rerun")
