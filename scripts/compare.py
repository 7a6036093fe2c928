"""The comparison of record in one command (issue 18): ``python scripts/compare.py [--dry-run] [key=value ...]``.

Reads ``configs/compare.yaml`` (``--config FILE`` for another; ``key=value`` overrides it,
omegaconf dotlist) and runs, each stage as a subprocess of this repository's entry points:

1. ``python -m data_prep`` once: one cache (``<output_dir>/cache``) for every head; or, with ``prep``
   a map of named override lists, one cache per name (``<output_dir>/caches/<name>``, e.g. the same
   conversations with teacher-forced and with regenerated labels), a head training on the one its
   ``cache`` entry names (default the first);
2. per head, ``python -m train heads=<head>`` with the same budget for every head: a wall clock
   ``train.max_time=<train_max_time>`` and/or the overrides of ``train_budget`` (e.g.
   ``[train.max_epochs=1, train.max_steps=-1]``: an equal token budget, one epoch of one cache),
   into ``<output_dir>/runs/<head>/compare-<name>``;
   ``train_parallel`` heads at once, so every head gets the same share of the machine
   (:meth:`Driver.train`);
3. the evaluation protocol on each head's ``best/`` (else ``last/``), per **evaluation group**:
   heads of one ``heads=`` option with the same ``eval`` overrides (e.g. ctc, ctc with
   ``loss=ce`` and the 49k-row ctc) are the ``eval.variants`` of one run, so they share one vanilla
   decoding (the same reference, and one vanilla pass instead of three).  First a timing run on
   ``eval.timing_per_category`` questions per category with ``eval.repeats`` rounds on
   ``eval.timing_threads`` threads (all cores by default), which sizes each head's tree for those
   threads (``eval.tree=auto``: the cost model and calibration are measured then, on a quiet
   machine); then ``eval.shards`` processes (one thread each) decode disjoint question ranges,
   every turn, for τ and parity, with ``eval.quality_overrides`` (default ``eval.tree_nodes=16
   eval.tree_objective=tau``: each head's highest-τ tree of one node budget, so τ compares heads, not trees
   or drafter costs) and ``eval.plan_threads`` = the
   timing threads (the cost model and calibration are read from the cache, not re-measured on a
   loaded machine; without a fixed budget they decode with the timing run's tree); ``python -m evaluation.merge``
   joins them and one resumed pass writes the report.  Reports: ``eval/<name>/{timing,quality}/``
   for a group of one head, ``eval/<group>/{timing,quality}/<name>/`` for a group of several
   (``<group>`` = the names joined by ``+``);
4. ``summary.md`` / ``summary.json`` in ``<output_dir>`` (:mod:`evaluation.summary`) with the
   training steps, seconds and tokens seen of each head, and ``val_curves.png``: every trained
   head's validation τ against tokens seen (:func:`train.val_schedule.plot_curves`; drawn even
   before any evaluation has run), and ``budget.md``: each trained head's validation τ at the end
   of its budget and at equal wall clock, per share of the machine (:mod:`train.budget`).

``stages`` (default all of prep, train, eval, summary) selects what this invocation runs.

Resume: a finished stage leaves ``<output_dir>/stages/<stage>.done`` and is skipped; an
interrupted one is run again with ``resume=auto`` (data prep skips finished shards, training
continues from ``last.ckpt`` with the time already spent, evaluations keep decoded prompts).  Each
stage's output goes to ``<output_dir>/logs/<stage>.log``.  A head whose ``configs/heads/<head>.yaml``
or registered head type does not exist yet is skipped with a message.  ``--dry-run`` prints the
stages and their commands without running anything.

Exit status: 0; 1 when a head's outputs differ from vanilla greedy decoding (the reports and the
summary are still written); 2 on a bad configuration (before anything runs); a failed stage's own
exit status otherwise (its log is named; run again to resume).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: E402

from core.config import UserInputError, check_output_path  # noqa: E402
from core.io import atomic_write_json  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "compare.yaml"
STAGES = ("prep", "train", "eval", "summary")
# the data keys that decide which conversations are held out: every stage must see the same values
SPLIT_DATA_KEYS = ("data.path", "data.sources", "data.split", "data.format", "data.reader", "data.encoding",
                   "data.heldout_fraction", "data.split_salt", "data.split_key")


def load_config(path: Path, overrides: Sequence[str]) -> DictConfig:
    """The driver config: ``path`` with dotlist ``overrides`` merged.

    Raises:
        UserInputError: the file is missing, an override names an unknown key, or a value is
            invalid (the key is named).
        core.config.ConfigError: ``output_dir`` cannot become a folder to write into.
    """
    if not path.is_file():
        raise UserInputError(f"--config {path}: file not found")
    cfg = OmegaConf.load(path)
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" not in o or OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise UserInputError(f"{o!r}: not a key=value override of a key in {path.name}")
    cfg.merge_with_dotlist(list(overrides))
    check_output_path(cfg, "output_dir")
    budget = cfg.get("train_max_time")
    if budget is not None and not (isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0):
        raise UserInputError(f"train_max_time={budget!r} must be a number of seconds > 0, or null")
    if budget is None and not cfg.get("train_budget"):
        raise UserInputError("no training budget: set train_max_time (seconds) or train_budget "
                             "(e.g. [train.max_epochs=1, train.max_steps=-1]: an equal token budget)")
    prep = cfg.get("prep")
    if not isinstance(prep, (ListConfig, DictConfig)) or (isinstance(prep, DictConfig) and not prep):
        raise UserInputError("prep must be a list of data_prep overrides (one cache) or a non-empty map "
                             "{cache name: [overrides]}")
    for name, overrides in ([("prep", prep)] if isinstance(prep, ListConfig) else
                            [(f"prep.{n}", v) for n, v in prep.items()]):
        split_keys = [o for o in overrides if str(o).split("=", 1)[0] in SPLIT_DATA_KEYS]
        if split_keys:  # evaluation reads the held-out split too (auto-tree calibration, held-out prompts)
            raise UserInputError(f"{name}: {', '.join(map(str, split_keys))} define the train/held-out split, which "
                                 "evaluation reads as well (calibration prompts are held-out conversations): put "
                                 "them in common so every stage sees the same split")
    for key in ("shards", "repeats", "prompts_per_category", "timing_per_category", "max_new_tokens"):
        v = cfg.eval[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserInputError(f"eval.{key}={v!r} must be an integer >= 1")
    if not Path(str(cfg.eval.prompts)).is_file():
        raise UserInputError(f"eval.prompts={cfg.eval.prompts!r}: file not found; the comparison reports on MT-bench: "
                             "pass eval.prompts=/path/to/question.jsonl (FastChat's "
                             "fastchat/llm_judge/data/mt_bench/question.jsonl, docs/glossary.md)")
    from evaluation.prompts import PromptError, read_jsonl_records

    try:  # every line checked now: the evaluation stages that read it run hours after data prep
        read_jsonl_records(str(cfg.eval.prompts))
    except PromptError as exc:
        raise UserInputError(str(exc)) from None
    # relative paths are the caller's; the stages run in the repository root
    cfg.eval.prompts = str(Path(str(cfg.eval.prompts)).resolve())
    cfg.output_dir = str(Path(str(cfg.output_dir)).resolve())
    p = cfg.get("train_parallel", 1)
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise UserInputError(f"train_parallel={p!r} must be an integer >= 1")
    bad = [s for s in cfg.stages if s not in STAGES]
    if bad or not cfg.stages:
        raise UserInputError(f"stages={list(cfg.stages)!r}: expected a non-empty subset of {list(STAGES)}")
    if not isinstance(cfg.heads_to_run, ListConfig):  # a string was read letter by letter
        raise UserInputError(f"heads_to_run={cfg.heads_to_run!r} must be a list of names under heads, e.g. "
                             f"'heads_to_run=[{cfg.heads_to_run}]'")
    for name in cfg.heads_to_run:
        if name not in cfg.heads:
            raise UserInputError(f"heads_to_run: {name!r} has no entry under heads (have {', '.join(cfg.heads)})")
        which = cfg.heads[name].get("cache")
        if which is not None and which not in cache_names(cfg):
            raise UserInputError(f"heads.{name}.cache={which!r}: not a cache of prep (have {', '.join(cache_names(cfg))})")
    check_stage_overrides(cfg)
    return cfg


def check_stage_overrides(cfg: DictConfig) -> None:
    """Compose every stage's overrides as its entry point will (data prep per cache; training and evaluation per
    selected head), so an unknown key or a bad value in ``common``, ``prep``, ``train``, ``eval.*overrides`` or
    a head's ``overrides`` / ``eval`` is refused now, not when its stage starts hours later.

    Raises:
        UserInputError: naming where the override came from and the entry point's message.
    """
    from core.config import ConfigError, compose
    from evaluation.__main__ import check_head_overrides, rewrite_argv

    common = [str(o) for o in cfg.get("common") or []]
    prep = cfg.prep if isinstance(cfg.prep, DictConfig) else {"cache": cfg.prep}
    plans = [(f"prep{'' if not isinstance(cfg.prep, DictConfig) else '.' + n}", common + [str(o) for o in v])
             for n, v in prep.items()]
    for name in cfg.heads_to_run:
        h = cfg.heads[name]
        if head_available(str(h.head)):
            continue  # skipped with its reason when the stages run
        head = [f"heads={h.head}"]
        plans.append((f"training of {name} (train, train_budget, heads.{name}.overrides)",
                      common + head + [str(o) for o in (*cfg.train, *(cfg.get("train_budget") or []), *h.overrides)]))
        plans.append((f"evaluation of {name} (eval.overrides, eval.quality_overrides, heads.{name}.eval)",
                      rewrite_argv(common + head + [str(o) for o in (*cfg.eval.overrides,
                                                                      *(cfg.eval.get("quality_overrides") or []),
                                                                      *h.get("eval", []))])))
    for where, args in plans:
        try:
            if where.startswith("evaluation"):
                check_head_overrides(args)
            compose(args)
        except (ConfigError, UserInputError, ValueError) as exc:
            raise UserInputError(f"{where}: {exc}") from None


def cache_names(cfg: DictConfig) -> list[str]:
    """The caches ``prep`` defines: ``["cache"]`` for a list of overrides, else the map's names in order."""
    return list(cfg.prep) if isinstance(cfg.prep, DictConfig) else ["cache"]


def head_available(head: str) -> str | None:
    """None when ``heads=<head>`` can run, else why not (no config file, or type not registered)."""
    path = ROOT / "configs" / "heads" / f"{head}.yaml"
    if not path.is_file():
        return f"no configs/heads/{head}.yaml"
    from heads.registry import head_class

    head_type = OmegaConf.load(path).get("type")
    try:
        head_class(str(head_type))
    except KeyError:
        return f"head type {head_type!r} is not registered in heads/"
    return None


def count_questions(prompts: str, per_category: int) -> int:
    """Questions the protocol selects: the first ``per_category`` records of each category."""
    from evaluation.prompts import read_jsonl_records

    taken: dict[Any, int] = {}
    for rec in read_jsonl_records(prompts):
        taken[rec["category"]] = min(per_category, taken.get(rec["category"], 0) + 1)
    return sum(taken.values())


@contextlib.contextmanager
def forwarded_signals(procs: list[subprocess.Popen]):
    """While stage processes run, a SIGTERM, SIGINT or SIGHUP to the driver is passed on to each of them
    (training checkpoints a whole optimizer step and stops, data prep keeps its finished shards, an evaluation
    keeps its decoded prompts) and the driver waits for them, then reports the stage as failed: stopping the
    driver used to leave its stage running alone, and a second driver would have run beside it."""
    received: list[int] = []

    def forward(signum, frame):  # noqa: ARG001
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT if signum == signal.SIGHUP else signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if received:
            print(f"compare: stopped by signal {received[0]}; its stages were told to stop and have ended: run the "
                  "same command again to resume", file=sys.stderr)


@contextlib.contextmanager
def driver_lock(out: Path):
    """One driver at a time per ``output_dir`` (an exclusive lock on ``<output_dir>/.compare.lock``): two would
    run the same stage into the same folders.

    Raises:
        UserInputError: another driver holds it.
    """
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".compare.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserInputError(f"another scripts/compare.py is running on {out} (it holds {out / '.compare.lock'}); "
                                 "wait for it, or stop it (its stages stop with it) and run again") from None
        yield


def check_same_commands(stage: str, done: Path, recorded, commands: list[list[str]]) -> None:
    """Refuse to skip a finished stage whose commands (less the interpreter's path) differ from this run's:
    its outputs were made under other settings, and the stages after it would build on them.

    Raises:
        UserInputError: naming the stage, the first differing argument and the ways out.
    """
    if recorded is None:  # a marker written before the commands were recorded
        return
    old = [list(c[1:]) for c in recorded]
    new = [list(c[1:]) for c in commands]
    if old == new:
        return
    diff = next(((a, b) for o, n in zip(old, new) for a, b in zip(o + [None] * len(n), n + [None] * len(o))
                 if a != b), (f"{len(old)} commands", f"{len(new)} commands"))
    raise UserInputError(f"stage {stage} finished earlier with other settings ({diff[0]!r} -> {diff[1]!r}), so its "
                         f"outputs do not follow this configuration: use another output_dir, or delete {done} and that "
                         "stage's outputs to run it again")


class Driver:
    """Runs the stages of one comparison (see the module docstring)."""

    def __init__(self, cfg: DictConfig, dry_run: bool = False) -> None:
        self.cfg, self.dry_run = cfg, dry_run
        self.out = Path(str(cfg.output_dir))
        self.py = sys.executable
        self.parity_failures: list[str] = []

    # -- plumbing -------------------------------------------------------------------------------
    def _done(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.done"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("WANDB_MODE", "offline")
        return env

    def run_stage(self, stage: str, commands: list[list[str]], ok_codes=(0,)) -> int:
        """Run ``commands`` in parallel (one process each) unless ``stage`` is done; returns the
        worst exit status (0 when skipped).  Exits the driver on a status not in ``ok_codes``."""
        return self.run_stages([(stage, commands)], ok_codes)[0]

    def run_stages(self, stages: list[tuple[str, list[list[str]]]], ok_codes=(0,),
                   threads: int | None = None, cpus: list[int] | None = None) -> list[int]:
        """Run several stages at once, each as :meth:`run_stage` would (done ones are skipped, each
        finished one leaves its own marker); ``threads`` sets ``OMP_NUM_THREADS`` of their processes
        and ``cpus`` (Linux) the CPUs they may run on.

        Returns:
            Each stage's worst exit status, in order.  Exits the driver (after every process has
            ended, markers written for the stages that succeeded) on a status not in ``ok_codes``.
        """
        env = self._env()
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        logs = self.out / "logs"
        running: list[tuple[str, list[list[str]], list, float]] = []
        results: dict[str, int] = {}
        for stage, commands in stages:
            done = self._done(stage)
            if done.is_file():
                record = json.loads(done.read_text())
                check_same_commands(stage, done, record.get("commands"), commands)
                print(f"[skip] {stage}: done earlier ({done})")
                results[stage] = record.get("status", 0)
                continue
            print(f"[run ] {stage}" + ("" if len(commands) == 1 else f" ({len(commands)} processes in parallel)")
                  + (f" [OMP_NUM_THREADS={threads}]" if threads else "") + (f" [CPUs {cpus}]" if cpus else ""))
            for c in commands:
                print("       " + " ".join(_quote(a) for a in c))
            if self.dry_run:
                results[stage] = 0
                continue
            logs.mkdir(parents=True, exist_ok=True)
            procs = []
            for k, c in enumerate(commands):
                log = open(logs / (f"{stage}.log" if len(commands) == 1 else f"{stage}.{k}.log"), "a", encoding="utf-8")
                log.write(f"\n$ {' '.join(_quote(a) for a in c)}\n")
                log.flush()
                pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
                procs.append((subprocess.Popen(c, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               preexec_fn=pin), log))
            running.append((stage, commands, procs, time.time()))
        failed = []
        with forwarded_signals([p for _, _, procs, _ in running for p, _ in procs]):
            for _, _, procs, _ in running:
                for p, _ in procs:
                    p.wait()
        for stage, commands, procs, t0 in running:
            codes = []
            for p, log in procs:
                codes.append(p.wait())
                log.close()
            status = max(codes, key=lambda c: (c not in ok_codes, abs(c)))
            results[stage] = status
            if status not in ok_codes:
                print(f"error: stage {stage} failed with exit status {status}; see {logs}/{stage}*.log, "
                      "then run the same command again to resume", file=sys.stderr)
                failed.append(status)
            else:
                atomic_write_json(self._done(stage), {"status": status, "seconds": time.time() - t0,
                                                      "commands": commands, "threads": threads})
        if failed:
            raise SystemExit(failed[0])
        return [results[s] for s, _ in stages]

    # -- stages ---------------------------------------------------------------------------------
    def cache_dir(self, name: str | None = None) -> Path:
        """``<output_dir>/cache`` for a single cache (``prep`` a list), ``<output_dir>/caches/<name>`` for
        one of several (``prep`` a map); ``name`` None = the first."""
        if not isinstance(self.cfg.prep, DictConfig):
            return self.out / "cache"
        return self.out / "caches" / (name or cache_names(self.cfg)[0])

    def head_cache(self, name: str) -> Path:
        """The cache head ``name`` trains on (its ``cache`` entry; default the first)."""
        return self.cache_dir(self.cfg.heads[name].get("cache"))

    def prepare(self) -> None:
        """One data-prep stage per cache (``prep``; the caches of a map run one after another, each on
        all cores: ``prep``, or ``prep-<name>``).  A cache that no head of ``heads_to_run`` trains on is
        skipped with a line (it is built by the run that selects such a head)."""
        c = self.cfg
        specs = [("prep", list(c.prep))] if not isinstance(c.prep, DictConfig) else \
            [(f"prep-{n}", list(c.prep[n])) for n in cache_names(c)]
        used = {self.head_cache(n) for n in c.heads_to_run}
        for (stage, overrides), name in zip(specs, cache_names(c)):
            if self.cache_dir(name) not in used:
                print(f"[compare] {stage}: skipped, no head in heads_to_run trains on cache {name!r}", flush=True)
                continue
            self.run_stage(stage, [[self.py, "-m", "data_prep", *c.common, *overrides,
                                    f"prep.cache_dir={self.cache_dir(name)}",
                                    "prep.progress=false", f"output_root={self.out}"]])

    def head_args(self, name: str) -> list[str]:
        h = self.cfg.heads[name]
        return [f"heads={h.head}", *self.cfg.common, *h.overrides]

    def run_dir(self, name: str) -> Path:
        """``<output_dir>/runs/<heads option>/compare-<name>`` (:func:`train.run_dirs.runs_root`)."""
        return self.out / "runs" / str(self.cfg.heads[name].head) / f"compare-{name}"

    def train_command(self, name: str) -> list[str]:
        c = self.cfg
        budget = ([f"train.max_time={c.train_max_time}"] if c.get("train_max_time") is not None else []) + \
            list(c.get("train_budget") or [])
        return [self.py, "-m", "train", *self.head_args(name), *c.train, *budget,
                f"train.cache_dir={self.head_cache(name)}", f"train.run_name=compare-{name}", f"output_root={self.out}",
                "resume=auto", "train.progress_bar=false"]

    def train(self, names: list[str]) -> None:
        """Train ``names`` in groups of ``train_parallel`` = P heads at once, so that every head has
        the same share of the machine, C / P cores (C = ``os.cpu_count()``), for the same
        ``train_max_time``.  P ≤ C: each process gets C // P threads.  P > C: one thread each, and a
        group of g < P heads (the last one) is pinned to ⌈g·C / P⌉ CPUs, so its heads do not get
        more than C / P cores either (on 2 cores, P = 4: half a core each; the last pair shares one
        core)."""
        p = int(self.cfg.train_parallel)
        ncpu = os.cpu_count() or 1
        threads = max(1, ncpu // p) if p > 1 else None
        for i in range(0, len(names), p):
            group = names[i:i + p]
            cpus = None
            if p > ncpu and len(group) < p and hasattr(os, "sched_setaffinity"):
                cpus = sorted(os.sched_getaffinity(0))[:max(1, math.ceil(len(group) * ncpu / p))]
            self.run_stages([(f"train-{n}", [self.train_command(n)]) for n in group], threads=threads, cpus=cpus)

    def checkpoint(self, name: str) -> Path:
        run = self.run_dir(name)
        return run / "best" if (run / "best" / "model.safetensors").is_file() or self.dry_run else run / "last"

    def eval_groups(self, names: list[str]) -> list[list[str]]:
        """``names`` grouped by (``heads=`` option, ``eval`` overrides), in first-appearance order:
        each group is evaluated by one run with one ``eval.variants`` entry per head."""
        groups: dict[tuple, list[str]] = {}
        for n in names:
            h = self.cfg.heads[n]
            groups.setdefault((str(h.head), tuple(map(str, h.eval))), []).append(n)
        return list(groups.values())

    def report_dir(self, name: str, kind: str, group: list[str]) -> Path:
        """Where head ``name``'s ``kind`` (``quality`` / ``timing`` / ``shard<k>``) report lies, in
        its evaluation group ``group`` (:meth:`eval_groups`)."""
        if len(group) == 1:
            return self.out / "eval" / name / kind
        return self.out / "eval" / "+".join(group) / kind / name

    def evaluate(self, group: list[str]) -> None:
        """The evaluation protocol (module doc, step 3) for one group of heads: timing first (on all
        cores; it sizes the trees), then the τ/parity shards on one thread each with
        ``eval.plan_threads`` = the timing threads, their merge and the report pass."""
        c, e = self.cfg, self.cfg.eval
        first = c.heads[group[0]]
        gname = "+".join(group)
        gdir = self.out / "eval" / gname
        if len(group) == 1:
            which = [f"eval.checkpoint={self.checkpoint(gname)}"]
        else:
            spec = ", ".join(f"{{name: {n}, checkpoint: '{self.checkpoint(n)}'}}" for n in group)
            which = [f"eval.variants=[{spec}]"]
        base = [self.py, "-m", "evaluation", f"heads={first.head}", *c.common, *first.eval, *e.overrides, *which,
                f"eval.prompts={e.prompts}", f"eval.turns={e.turns}", f"eval.max_new_tokens={e.max_new_tokens}",
                f"output_root={self.out}", "resume=auto"]
        ok = (0, 1)  # 1 = parity failure: the reports are written; the summary shows it
        threads = int(e.timing_threads or os.cpu_count() or 1)
        codes = [self.run_stage(f"eval-{gname}-timing", [base + [
            f"eval.prompts_per_category={e.timing_per_category}", f"eval.repeats={e.repeats}",
            f"eval.threads={threads}", f"eval.output_dir={gdir / 'timing'}"]], ok)]
        n = count_questions(str(e.prompts), int(e.prompts_per_category))
        per = math.ceil(n / int(e.shards))
        quality = base + [*e.get("quality_overrides", []), f"eval.prompts_per_category={e.prompts_per_category}",
                          "eval.threads=1", f"eval.plan_threads={threads}"]
        shard_dirs = [gdir / f"shard{k}" for k in range(int(e.shards)) if k * per < n]
        codes.append(self.run_stage(f"eval-{gname}-shards", [
            quality + [f"eval.prompt_offset={k * per}", f"eval.num_prompts={per}", f"eval.output_dir={d}"]
            for k, d in enumerate(shard_dirs)], ok))
        self.run_stage(f"eval-{gname}-merge", [[self.py, "-m", "evaluation.merge", "--no-report", str(gdir / "quality"),
                                                *map(str, shard_dirs)]])
        codes.append(self.run_stage(f"eval-{gname}-report", [quality + [
            "eval.prompt_offset=0", f"eval.num_prompts={n}", f"eval.output_dir={gdir / 'quality'}"]], ok))
        if any(codes):
            self.parity_failures.append(gname)

    def training_record(self, name: str) -> dict[str, Any]:
        """Steps and training seconds of a head's run (the ``extra`` of its exported ``last/`` and
        of the evaluated checkpoint; ``train_seconds`` is Lightning's Timer over all resumed segments,
        or, under a token budget, the run record's time inside training batches, :mod:`train.val_schedule`)."""
        out: dict[str, Any] = {}
        for key, d in (("last", self.run_dir(name) / "last"), ("evaluated", self.checkpoint(name))):
            f = d / "config.json"
            if f.is_file():
                extra = json.loads(f.read_text(encoding="utf-8")).get("extra") or {}
                if key == "last":
                    out.update(train_steps=extra.get("global_step"), train_seconds=extra.get("train_seconds"),
                               train_tokens=self.train_tokens(name, extra.get("global_step")))
                else:
                    out.update(evaluated_checkpoint=str(d), evaluated_step=extra.get("global_step"))
        record = self.run_dir(name) / "record.json"
        if out.get("train_seconds") is None and record.is_file():  # a token budget has no Timer: the run record's
            out["train_seconds"] = json.loads(record.read_text(encoding="utf-8")).get("train_seconds")
        return out

    def train_tokens(self, name: str, steps: int | None) -> int | None:
        """Tokens of the training batches of a head's first ``steps`` optimizer steps, replayed from
        its run's ``config.yaml`` and the cache's record lengths (:func:`train.data.tokens_seen`;
        one process, as this driver trains); None without a run config or step count."""
        from train.data import make_batches, open_split, record_lengths, tokens_seen

        f = self.run_dir(name) / "config.yaml"
        if steps is None or not f.is_file():
            return None
        run = OmegaConf.load(f)
        t = run.train
        lengths = record_lengths(open_split(str(t.cache_dir or self.head_cache(name)), "train"))
        batches = make_batches(lengths, t.batch_size, t.max_tokens, int(run.seed), bool(t.shuffle), int(t.bucket_size))
        return tokens_seen(lengths, batches, int(steps), int(run.seed), bool(t.shuffle), 1,
                           int(t.accumulate_grad_batches))

    def run_records(self, names: list[str], what: str) -> dict[str, dict]:
        """``{name: record.json}`` of the heads that have one, read and checked by
        :func:`train.budget.load_record`; one that cannot be read is left out of ``what`` with a
        ``[skip]`` line naming it, so it never costs the rest of the summary."""
        from train.budget import load_record
        from train.val_schedule import RECORD

        records = {}
        for n in names:
            f = self.run_dir(n) / RECORD
            if not f.is_file():
                continue
            try:
                records[n] = load_record(f)
            except ValueError as exc:
                print(f"[skip] {what}: {n}: {exc}")
        return records

    def plot_val_curves(self, names: list[str]) -> Path | None:
        """``<output_dir>/val_curves.png`` from the runs' ``record.json`` (those with a validation τ),
        or None (and a ``[skip]`` line) when none has one: a head monitored by its loss alone
        (AdaDecode) has no τ to draw, and that must not stop the summary."""
        from train.val_schedule import plot_curves

        if self.dry_run:
            return None
        records = self.run_records(names, "validation τ curves")
        path = self.out / "val_curves.png"
        try:
            drawn = plot_curves(records, path, title="validation τ against tokens seen, per head")
        except ValueError as exc:
            print(f"[skip] validation τ curves: {exc}")
            return None
        print(f"[done] validation τ curves of {', '.join(drawn)} -> {path}")
        return path

    def budget_table(self, names: list[str]) -> Path | None:
        """``<output_dir>/budget.md``: every trained head's validation τ at the end of its budget (equal
        tokens under a token budget) and at equal wall clock (:mod:`train.budget`, per share of the
        machine), from the runs' ``record.json``; None (and a ``[skip]`` line) when no run has a τ.  A
        record that cannot be read is left out with a ``[skip]`` line naming it."""
        from core.io import atomic_write_text
        from train.budget import budget_markdown, budget_rows

        if self.dry_run:
            return None
        records = {n: r for n, r in self.run_records(names, "budget table").items()
                   if any((v.get("metrics") or {}).get("sim_tau") is not None for v in r["validations"])}
        if not records:
            print("[skip] budget table: no run record with a validation τ")
            return None
        path = self.out / "budget.md"
        atomic_write_text(path, "# Validation τ at equal tokens and at equal wall clock\n\n"
                          + budget_markdown(budget_rows(records)))
        print(f"[done] budget table of {', '.join(records)} -> {path}")
        return path

    def summarize(self, names: list[str]) -> None:
        from core.io import atomic_write_text
        from evaluation.summary import combine, summary_markdown

        groups = {n: g for g in self.eval_groups(names) for n in g}
        quality = {n: self.report_dir(n, "quality", groups[n]) for n in names}
        if not self.dry_run:  # a head not evaluated yet (stages=[train, summary]) is named, not a crash
            missing = [n for n in names if not (quality[n] / "report.json").is_file()]
            for n in missing:
                print(f"[skip] summary: {n} has no evaluation report yet ({quality[n]})")
            names = [n for n in names if n not in missing]
        entries = [(n, quality[n], self.report_dir(n, "timing", groups[n])) for n in names]
        if not names:  # it said "[run ] summary of no evaluated head -> summary.md" and wrote nothing
            print("[skip] summary: no head has an evaluation report yet (run the eval stage first); summary.md not "
                  "written")
            return
        print(f"[run ] summary of {', '.join(names)} -> {self.out / 'summary.md'}")
        if self.dry_run:
            return
        rows = combine(entries)
        for row, n in zip(rows, names):
            row.update(self.training_record(n))
        atomic_write_json(self.out / "summary.json", {"rows": rows, "config": OmegaConf.to_container(self.cfg)})
        atomic_write_text(self.out / "summary.md", summary_markdown(rows))
        print((self.out / "summary.md").read_text(encoding="utf-8"), end="")

    def run(self) -> int:
        names = []
        for name in self.cfg.heads_to_run:
            why = head_available(str(self.cfg.heads[name].head))
            if why:
                print(f"[skip] {name}: heads={self.cfg.heads[name].head} is not available yet ({why})")
            else:
                names.append(str(name))
        if not names:
            raise UserInputError("no head of heads_to_run is available")
        with contextlib.nullcontext() if self.dry_run else driver_lock(self.out):
            return self._run(names)

    def _run(self, names: list[str]) -> int:
        stages = set(self.cfg.stages)
        if "prep" in stages:
            self.prepare()
        if "train" in stages:
            self.train(names)
        if "eval" in stages:
            for group in self.eval_groups(names):
                self.evaluate(group)
        if "summary" in stages:
            self.plot_val_curves(names)
            self.budget_table(names)
            self.summarize(names)
        if self.parity_failures:
            print(f"PARITY FAILURE in {', '.join(self.parity_failures)} (see their eval/*/report.json)", file=sys.stderr)
            return 1
        return 0


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(str(a))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    dry = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    config = DEFAULT_CONFIG
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            print("error: --config needs a file", file=sys.stderr)
            return 2
        config = Path(args[i + 1])
        del args[i:i + 2]
    try:
        cfg = load_config(config, args)
        return Driver(cfg, dry_run=dry).run()
    except (UserInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
