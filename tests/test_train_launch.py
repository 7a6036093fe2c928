"""What a training launch claims and checks before it writes: its run directory, the resumed checkpoint's
config and ZeRO stage, ``best/`` when the best checkpoint is gone, the validation cadence, W&B's run id,
Slurm tasks, CPU devices and strategy keys (faults found by trying public bug reports, issue 27's round 3).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from core.config import ConfigError, UserInputError, compose


def _args(model_dir, root, cache, *extra):
    return [f"model.path={model_dir}", "model.dtype=float32", f"output_root={root}", "heads=ctc",
            "heads.attn_implementation=eager", f"train.cache_dir={cache}", "train.accelerator=cpu", "train.devices=1",
            "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", "train.batch_size=2",
            "train.max_steps=4", "train.val_every_n_steps=2", "train.save_top_k=-1", *extra]


@pytest.fixture(scope="module")
def run_a(tiny_model_dir, tmp_path_factory):
    """One finished 4-step ctc run ``a`` (validations at steps 2 and 4, every checkpoint kept)."""
    from data_prep.synthetic import write_random_cache
    from train.run import main

    root = tmp_path_factory.mktemp("launch")
    cache = write_random_cache(root / "cache", tiny_model_dir, n_train=8, n_val=4, length_range=(6, 14))
    main(_args(tiny_model_dir, root, cache, "train.run_name=a"))
    return root, cache, root / "runs" / "ctc" / "a"


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# The run directory is claimed: two launches never share one.
# ---------------------------------------------------------------------------------------------
def test_a_claimed_run_directory_refuses_a_second_launch_and_a_clock_name_moves_on(tmp_path):
    """Two runs started in the same second shared one clock-named directory: one's config.yaml, the
    other's weights, and the first crashed (wandb/wandb#4267's kind of collision)."""
    from train.run_dirs import RUN_NAME_ENV, claimed_run_dir

    run = tmp_path / "runs" / "ctc" / "20261207-130607"
    with claimed_run_dir(run, by_time=True) as first:
        assert first == run
        assert (run.parent / f".{run.name}.lock").read_text() == str(os.getpid())
        with claimed_run_dir(run, by_time=True) as second:  # the same second: the next free name
            assert second == run.with_name(run.name + "-2")
            assert os.environ[RUN_NAME_ENV] == f"{second.name}:{os.getpid()}"  # Lightning's other ranks follow
        with pytest.raises(UserInputError, match=rf"run directory {run} is in use by another training process "
                                                 rf"\(pid {os.getpid()}\): wait for it to end, or choose another "
                                                 r"train.run_name"):
            with claimed_run_dir(run, by_time=False):
                pass
        with claimed_run_dir(run, rank=1) as other_rank:  # ranks > 0 share rank 0's claim
            assert other_rank == run
    with claimed_run_dir(run, by_time=False) as again:  # released at the end of the block
        assert again == run
    assert not (tmp_path / "runs").exists()  # the lock file and the folders the claim made are gone


def test_clock_named_runs_of_the_same_second_get_their_own_directories(run_a, tiny_model_dir, monkeypatch):
    import train.run_dirs
    from train.run import main

    root, cache, _ = run_a
    monkeypatch.setattr(train.run_dirs.time, "strftime", lambda fmt, t=None: "20261207-130607")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = main(_args(tiny_model_dir, root, cache, "train.max_steps=2"))
    second = main(_args(tiny_model_dir, root, cache, "train.max_steps=2", "heads.aux_weight=1.0"))
    runs = root / "runs" / "ctc"
    assert Path(first["run_dir"]) == runs / "20261207-130607"
    assert Path(second["run_dir"]) == runs / "20261207-130607-2"
    assert "aux_weight: 1.0" in (runs / "20261207-130607-2" / "config.yaml").read_text()
    assert sorted(p.name for p in (runs / "20261207-130607" / "checkpoints").iterdir()) == [
        "last.ckpt", "step0000002.ckpt"]


# ---------------------------------------------------------------------------------------------
# best/ is never the final weights relabelled.
# ---------------------------------------------------------------------------------------------
def test_a_resume_whose_best_checkpoint_is_gone_keeps_best(run_a, tiny_model_dir, capsys):
    """The resume exported the final weights as best/ (``last-no-validation``) although validations had run
    and record.json still named the earlier step (transformers#48319's kind)."""
    from train.run import main

    root, cache, _ = run_a
    main(_args(tiny_model_dir, root, cache, "train.run_name=gone"))
    copy = root / "runs" / "ctc" / "gone"
    record = json.loads((copy / "record.json").read_text())
    best_step = int(json.loads((copy / "best" / "config.json").read_text())["extra"]["global_step"])
    (copy / "checkpoints" / f"step{best_step:07d}.ckpt").unlink()
    before = (copy / "best" / "model.safetensors").read_bytes()
    capsys.readouterr()
    main(_args(tiny_model_dir, root, cache, "train.run_name=gone", "resume=auto"))
    assert (copy / "best" / "model.safetensors").read_bytes() == before
    assert json.loads((copy / "best" / "config.json").read_text())["extra"]["checkpoint"] == "best"  # not relabelled
    assert json.loads((copy / "record.json").read_text())["best"] == record["best"]
    err = capsys.readouterr().err
    assert (f"draftheads: the best validation's checkpoint {copy / 'checkpoints' / f'step{best_step:07d}.ckpt'} is "
            f"missing, so {copy / 'best'} is left as it was (exported from it earlier); {copy / 'last'} holds the "
            "final weights") in err, err


# ---------------------------------------------------------------------------------------------
# A checkpoint away from its run folder is checked against the config it carries.
# ---------------------------------------------------------------------------------------------
def test_a_copied_checkpoint_carries_its_config_and_a_changed_resume_is_refused(run_a, tiny_model_dir, capsys):
    """``resume=<copied file> train.batch_size=2->1 lr=...`` compared against nothing: 4 conversations
    trained twice (SimpleTuner#3093's kind)."""
    from omegaconf import OmegaConf

    from train.checkpoint_io import checkpoint_entry
    from train.run import main

    root, cache, a = run_a
    carried = checkpoint_entry(a / "checkpoints" / "step0000002.ckpt", "run_config")
    assert carried == OmegaConf.to_container(OmegaConf.load(a / "config.yaml"), resolve=True)
    copied = root / "copied.ckpt"
    shutil.copy(a / "checkpoints" / "step0000002.ckpt", copied)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny_model_dir, root, cache, "train.run_name=fromcopy", f"resume={copied}",
                   "train.batch_size=1", "train.optimizer.lr=0.5"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    lr = carried["train"]["optimizer"]["lr"]
    assert exc.value.code == 2 and err.startswith(f"error: resume of {root / 'runs' / 'ctc' / 'fromcopy'} would "
                                                  "change what the run trains: train.batch_size: 2 -> 1, "
                                                  f"train.optimizer.lr: {lr!r} -> 0.5; resume with the recorded "
                                                  f"settings ({copied})"), err
    assert not (root / "runs" / "ctc" / "fromcopy").exists()
    # the same settings resume it, and best/ comes from the ranked checkpoint in its old folder
    out = main(_args(tiny_model_dir, root, cache, "train.run_name=fromcopy", f"resume={copied}"))
    assert int(out["trainer"].global_step) == 4
    assert (root / "runs" / "ctc" / "fromcopy" / "best" / "model.safetensors").is_file()


def test_a_checkpoint_without_a_config_away_from_its_run_is_refused(tmp_path):
    from train.checkpoint_io import dumps
    from train.resume import check_resume_config

    old = tmp_path / "old.ckpt"
    old.write_bytes(dumps({"global_step": 2, "state_dict": {}}))
    cfg = compose([])
    with pytest.raises(UserInputError, match=rf"resume={old} refused: neither {tmp_path / 'new' / 'config.yaml'} nor "
                                             "the checkpoint records the config it was trained with"):
        check_resume_config(cfg, tmp_path / "new", old)
    check_resume_config(cfg, tmp_path / "new")  # a fresh directory, no checkpoint: nothing to compare


def test_slurm_checkpoints_belong_to_their_run_directory(tmp_path):
    """Lightning's ``<run>/hpc_ckpt_<n>.ckpt`` (Slurm requeue) was taken for a checkpoint of ``<run>/..``."""
    from train.resume import run_dir_of

    assert run_dir_of(tmp_path / "r" / "checkpoints" / "last.ckpt") == tmp_path / "r"
    assert run_dir_of(tmp_path / "r" / "hpc_ckpt_3.ckpt") == tmp_path / "r"
    assert run_dir_of(tmp_path / "copied.ckpt") is None


# ---------------------------------------------------------------------------------------------
# The strategy may change on resume, its ZeRO stage may not.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved,now,ok", [(0, 0, True), (1, 1, True), (1, 0, False), (0, 2, False), (1, 2, False)])
def test_a_resume_under_another_zero_stage_is_one_line(saved, now, ok, tmp_path):
    """ZeRO-1 -> auto ended in Lightning's KeyError blaming save_weights_only; ZeRO-1 -> 2 and plain -> ZeRO
    in tracebacks, after launches/1.yaml was written (pytorch-lightning#7282's kind)."""
    from train.resume import changed_run_keys, check_resume_strategy

    checkpoint = {"zero": {"stage": saved, "world_size": 1, "shards": "x"}} if saved else {}
    if ok:
        check_resume_strategy(checkpoint, tmp_path / "last.ckpt", now)
        return
    with pytest.raises(UserInputError) as exc:
        check_resume_strategy(checkpoint, tmp_path / "last.ckpt", now)
    name = {0: "no ZeRO (auto/ddp)", 1: "ZeRO-1", 2: "ZeRO-2"}
    way = f"strategy=deepspeed_zero{saved}" if saved else "strategy=auto (or strategy=ddp)"
    assert str(exc.value) == (f"resume from {tmp_path / 'last.ckpt'} refused: it was written under {name[saved]} and "
                              f"this launch runs {name[now]}; a ZeRO stage keeps its own optimizer partitions, so "
                              f"resume with {way}")
    # the config check lets the strategy option change (it said strategy.* may, then refused choices.strategy)
    assert changed_run_keys({"choices": {"strategy": "deepspeed_zero1"}, "strategy": {"zero_stage": 1}},
                            {"choices": {"strategy": "auto"}, "strategy": {"zero_stage": None}}) == {}


def test_zero_stage_is_zero_outside_deepspeed():
    from train.strategies import zero_stage

    assert zero_stage(compose(["strategy=deepspeed_zero2"])) == 2
    assert zero_stage(compose(["strategy=ddp"])) == 0


# ---------------------------------------------------------------------------------------------
# Validation cadence, the resume message.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total,every,said", [
    (8, 4, None),
    (6, 4, "the run has 6 optimizer steps, not a multiple of train.val_every_n_steps=4: the last 2 steps are never "
           "validated, so best/ cannot be the final weights (last/ always is)"),
    (3, 200, "the run has 3 optimizer steps, fewer than train.val_every_n_steps=200: it is never validated, so best/ "
             "will be the final weights (checkpoint last-no-validation); lower train.val_every_n_steps or use "
             "train.val_schedule=log (which validates at the last step)")])
def test_an_epoch_budget_that_is_never_validated_is_said(total, every, said):
    """An epoch budget below val_every_n_steps validated zero times without a word; only step budgets warned."""
    from train.val_schedule import unvalidated_tail

    assert unvalidated_tail(total, every) == said


def test_an_epoch_run_without_a_validation_warns(run_a, tiny_model_dir):
    from train.run import main

    root, cache, _ = run_a
    with pytest.warns(UserWarning, match="fewer than train.val_every_n_steps=200: it is never validated"):
        main(_args(tiny_model_dir, root, cache, "train.run_name=epoch", "train.max_steps=-1", "train.max_epochs=1",
                   "train.val_every_n_steps=200"))


def test_resume_auto_without_last_ckpt_names_the_step_checkpoint(run_a, tiny_model_dir, capsys):
    from train.run import main

    root, cache, a = run_a
    copy = a.with_name("a_nolast")
    shutil.copytree(a, copy)
    (copy / "checkpoints" / "last.ckpt").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(_args(tiny_model_dir, root, cache, "train.run_name=a_nolast", "resume=auto"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"resume=auto found no checkpoints/last.ckpt there; continue from its newest step checkpoint "
                        f"with resume={copy / 'checkpoints' / 'step0000004.ckpt'}, or choose another "
                        "train.run_name"), err


# ---------------------------------------------------------------------------------------------
# W&B run ids, Slurm tasks, CPU devices, strategy keys.
# ---------------------------------------------------------------------------------------------
def test_a_stray_wandb_run_id_is_taken_only_by_a_sweep(tmp_path, monkeypatch, capsys):
    """Every run started under an exported WANDB_RUN_ID logged into one W&B run (wandb/wandb#5119's kind)."""
    from train.run_logs import wandb_run_id

    monkeypatch.setenv("WANDB_RUN_ID", "deadbeef")
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    first, second = wandb_run_id(tmp_path / "w1"), wandb_run_id(tmp_path / "w2")
    assert "deadbeef" not in (first, second) and first != second
    assert "WANDB_RUN_ID=deadbeef is set outside a W&B sweep (no WANDB_SWEEP_ID): not taken" in capsys.readouterr().err
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")
    assert wandb_run_id(tmp_path / "w3") == "deadbeef"


@pytest.mark.parametrize("env,refused", [
    ({"SLURM_JOB_NAME": "interactive", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, True),
    ({"SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, False),   # salloc's shell: interactive mode
    ({"SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, False)])
def test_srun_tasks_of_an_interactive_job_are_refused(env, refused, monkeypatch):
    """Under salloc, ``srun python -m train`` made each task train its own copy into one run directory,
    silently (pytorch-lightning#20776, #16730)."""
    from train.strategies import check_slurm_tasks

    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["LOCAL_RANK"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if not refused:
        check_slurm_tasks()
        return
    with pytest.raises(UserInputError, match="2 srun tasks of the Slurm job named 'interactive': Lightning ignores "
                                             "Slurm for jobs named bash or interactive"):
        check_slurm_tasks()


def test_cpu_devices_are_counts(tiny_model_dir):
    """``train.devices=[0,1]`` and ``-1`` passed the check and died in Lightning's CPU parser after the base loaded."""
    from train.strategies import resolve_devices

    with pytest.raises(ConfigError, match=r"train.devices=\[0, 1\]: a list names GPU ids, and this run trains on the "
                                          "CPU, where train.devices counts processes"):
        compose([f"model.path={tiny_model_dir}", "train.accelerator=cpu", "train.devices=[0,1]"])
    assert resolve_devices(-1, "cpu", 1) == len(os.sched_getaffinity(0))
    assert resolve_devices(2, "cpu", 1) == 2


@pytest.mark.parametrize("overrides,key", [(["strategy=ddp", "strategy.overlap_comm=true"], "overlap_comm"),
                                           (["strategy=auto", "strategy.bucket_size=5"], "bucket_size"),
                                           (["strategy=auto", "strategy.find_unused_parameters=true"],
                                            "find_unused_parameters")])
def test_a_key_of_another_strategy_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=rf"strategy.{key}=\S+ needs "):
        compose(overrides)
    compose(["strategy=deepspeed_zero2", "strategy.overlap_comm=true", "strategy.bucket_size=5"])
    compose(["strategy=ddp", "strategy.find_unused_parameters=true"])
