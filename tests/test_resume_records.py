"""Records that stay true across resume (issue 19 items 1, 5, 6) and the data-loader mechanisms
of exact resume (issue 11): config changes refused before anything is written, W&B mode from
wandb's own credential look-up (a fake netrc), one W&B run id per run directory, one metrics CSV
whose steps match the checkpoint names, and the sampler / loader behaviour resume relies on."""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest
import torch

from core.config import compose


# --------------------------------------------------------------------------------------------
# Sampler and loader.
# --------------------------------------------------------------------------------------------
def test_loader_iterator_leaves_global_rng_alone():
    """Creating the training iterator must not draw from the global torch RNG: a resumed run
    creates it right after restoring the checkpoint's RNG state."""
    from train.data import ResumableDataLoader, ShardedBatchSampler

    dl = ResumableDataLoader(list(range(6)), batch_size=None, sampler=ShardedBatchSampler(6, shuffle=True, seed=1))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(dl))
    assert torch.equal(before, torch.get_rng_state())


def test_epoch_is_whole_accumulation_windows_and_skip_belongs_to_its_epoch():
    from train.data import ShardedBatchSampler

    s = ShardedBatchSampler(5, num_replicas=1, rank=0, shuffle=True, seed=3, window=2)
    assert len(s) == 6 and sorted(set(s.global_order())) == list(range(5))  # padded by a repeat
    s2 = ShardedBatchSampler(5, num_replicas=2, rank=1, shuffle=True, seed=3, window=2)
    assert len(s2) == 4 and len(s2.global_order()) == 8
    # a checkpoint at the end of epoch 0 (all consumed) resumes at epoch 1's first batch
    t = ShardedBatchSampler(5, shuffle=True, seed=3)
    t.load_state_dict({"epoch": 0, "consumed": 5})
    t.set_epoch(1)
    u = ShardedBatchSampler(5, shuffle=True, seed=3)
    u.set_epoch(1)
    assert list(t) == list(u) and len(list(t)) == 5
    # mid-epoch: Lightning calls set_epoch with the same epoch, the skip stays
    t.load_state_dict({"epoch": 1, "consumed": 2})
    t.set_epoch(1)
    assert list(t) == list(u)[2:]


# --------------------------------------------------------------------------------------------
# W&B mode and run id.
# --------------------------------------------------------------------------------------------
@pytest.fixture
def no_wandb_env(monkeypatch, tmp_path):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home" / ".netrc"


def _wandb_logger(tmp_path):
    from train.run import build_loggers

    cfg = compose(["train.logger=wandb", f"output_root={tmp_path}"])
    loggers = build_loggers(cfg, tmp_path / "run")
    return [lg for lg in loggers if type(lg).__name__ == "WandbLogger"][0]


def test_wandb_online_with_netrc_credentials(no_wandb_env, tmp_path):
    """``wandb login`` stores the key in ~/.netrc, not in WANDB_API_KEY: the run must go online."""
    no_wandb_env.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    no_wandb_env.chmod(0o600)
    logger = _wandb_logger(tmp_path)
    assert logger._offline is False and os.environ.get("WANDB_MODE") != "offline"


def test_wandb_offline_without_credentials_and_user_mode_wins(no_wandb_env, tmp_path, monkeypatch):
    assert _wandb_logger(tmp_path)._offline is True
    monkeypatch.delenv("WANDB_MODE", raising=False)
    no_wandb_env.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _wandb_logger(tmp_path)._offline is True


def test_one_wandb_run_id_per_run_directory(no_wandb_env, tmp_path, monkeypatch):
    from train.run_logs import record_wandb_run_id

    monkeypatch.setenv("WANDB_MODE", "offline")
    first = _wandb_logger(tmp_path)
    (tmp_path / "run").mkdir()
    record_wandb_run_id(tmp_path / "run", [first])  # train() does this once the run directory exists
    second = _wandb_logger(tmp_path)  # a resumed launch
    assert first._wandb_init["id"] and first._wandb_init["id"] == second._wandb_init["id"]
    assert first._wandb_init["resume"] == "allow"
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == first._wandb_init["id"]


# --------------------------------------------------------------------------------------------
# Resume refuses a changed config; one metrics record.
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctc_run(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache
    from train.run import main

    root = tmp_path_factory.mktemp("records")
    cache = write_random_cache(root / "cache", tiny_model_dir, n_train=8, n_val=4, length_range=(6, 14))
    args = [f"model.path={tiny_model_dir}", "model.dtype=float32", "heads=ctc", "heads.attn_implementation=eager",
            "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={root}",
            f"train.cache_dir={cache}", "train.run_name=r", "train.accelerator=cpu", "train.devices=1",
            "train.batch_size=4", "train.max_steps=4", "train.val_every_n_steps=2", "train.log_every_n_steps=1"]
    main(args)
    return root / "runs" / "ctc" / "r", args


def _snapshot(run_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


@pytest.mark.parametrize("change", [["heads.slots=8"], ["train.cache_dir=COPY"],
                                    ["train.optimizer.lr=0.5", "seed=7"]])
def test_resume_with_changed_config_is_refused_before_writing(ctc_run, change, capsys):
    """A head change (was a state-dict traceback after rewriting config.yaml), another cache with
    the same content (was accepted silently), training settings: all refused, nothing written."""
    import shutil

    from train.run import main

    run_dir, args = ctc_run
    if change == ["train.cache_dir=COPY"]:
        cache = Path([a for a in args if a.startswith("train.cache_dir=")][0].split("=", 1)[1])
        copy = cache.parent / "cache_copy"
        if not copy.exists():
            shutil.copytree(cache, copy)
        change = [f"train.cache_dir={copy}"]
    before = _snapshot(run_dir)
    with pytest.raises(SystemExit) as exc:
        main([*args, "resume=auto", *change])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for key in (c.split("=")[0] for c in change):
        assert key in err, err
    assert _snapshot(run_dir) == before  # config.yaml untouched, no csv version, nothing new


def test_metrics_one_record_steps_match_checkpoint_names(ctc_run):
    run_dir, args = ctc_run
    assert not list(run_dir.glob("csv/version_*"))
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    val_steps = [int(r["step"]) for r in rows if r.get("val/loss")]
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert train_steps == [1, 2, 3, 4] and val_steps == [2, 4]
    named = sorted(int(p.stem[4:]) for p in run_dir.glob("checkpoints/step*.ckpt"))
    assert named and set(named) <= set(val_steps)


def test_resume_may_change_devices_and_logging_and_records_the_launch(ctc_run):
    from train.run import main

    run_dir, args = ctc_run
    config = (run_dir / "config.yaml").read_text()
    main([*args, "resume=auto", "train.log_every_n_steps=2", "train.progress_bar=false"])
    assert (run_dir / "config.yaml").read_text() == config
    launches = sorted((run_dir / "launches").glob("*.yaml"))
    assert launches and "log_every_n_steps: 2" in launches[-1].read_text()


def test_progress_description_never_negative():
    from train.run_logs import progress_description

    assert progress_description(3, 1000, 0, -1) == "step 3/1000"
    assert progress_description(4, 10, 1, 2) == "step 4/10 · epoch 2/2"


# --------------------------------------------------------------------------------------------
# Process teardown.
# --------------------------------------------------------------------------------------------
def test_shutdown_distributed_destroys_the_process_group(tmp_path):
    """A finished process destroys its gloo group itself (a group left to interpreter exit made
    rank 1 of the ZeRO-3 resume in tests/test_distributed.py abort with exit -6, ~1 launch in 10)."""
    import torch.distributed as dist

    from train.strategies import shutdown_distributed

    if dist.is_initialized():
        pytest.skip("an earlier in-process run left a process group")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    out = torch.empty(1)
    dist.all_gather_into_tensor(out, torch.ones(1), async_op=True)  # a pending async collective, as ZeRO-3 leaves
    assert shutdown_distributed() is True
    assert not dist.is_initialized()
    assert shutdown_distributed() is False  # nothing left: a no-op


def test_cli_destroys_the_process_group_after_training_and_after_preemption(monkeypatch):
    """``python -m train`` (train.run.main) shuts the group down on every rank once training
    returned - also when it returned pre-empted, before the 128 + signal exit."""
    import core.config
    import train.strategies
    from train.resume import Preempted
    from train.run import main

    calls = []
    monkeypatch.setattr(train.strategies, "shutdown_distributed", lambda: calls.append("shutdown") or True)
    monkeypatch.setattr(core.config, "run_cli", lambda fn, argv, doc, **kw: {"preempted": None, "exports": {}})
    main([])
    assert calls == ["shutdown"]
    stop = Preempted(15, 3, "last.ckpt")
    monkeypatch.setattr(core.config, "run_cli", lambda fn, argv, doc, **kw: {"preempted": stop, "exports": {}})
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 128 + 15 and calls == ["shutdown", "shutdown"]


def test_offline_run_records_its_caches_labels_and_features_and_older_records_still_resume(tiny_model_dir,
                                                                                            tmp_path):
    """An offline run trains on its cache's labels and features: config.yaml records the cache's
    (teacher_forced, layer 1, float32 here), not data prep's defaults (regenerate, no layers,
    bfloat16); a run recorded with the defaults before this still resumes (the cache itself is checked
    by its data identity)."""
    import json

    from omegaconf import OmegaConf

    from data_prep.synthetic import write_random_cache
    from train.run import main

    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=8, n_val=4, length_range=(6, 14),
                               layers=(1,))
    for split in ("train", "val"):
        f = cache / split / "manifest.json"
        features = {"compute_dtype": "float32", "attn_implementation": "eager", "final_layer": 4, "layers": [1],
                    "storage_dtype": "float32", "labels": "teacher_forced"}  # as data prep records them
        f.write_text(json.dumps({**json.loads(f.read_text()), "labels": "teacher_forced", "features": features}))
    args = [f"model.path={tiny_model_dir}", "model.dtype=float32", "heads=ctc", "heads.attn_implementation=eager",
            "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={tmp_path}",
            f"train.cache_dir={cache}", "train.run_name=r", "train.accelerator=cpu", "train.devices=1",
            "train.batch_size=4", "train.val_every_n_steps=2"]
    assert OmegaConf.load(Path(__file__).parents[1] / "configs" / "config.yaml").labels == "regenerate"
    main([*args, "train.max_steps=2"])
    run_dir = tmp_path / "runs" / "ctc" / "r"
    recorded = OmegaConf.load(run_dir / "config.yaml")
    assert recorded.labels == "teacher_forced"
    assert list(recorded.prep.layers) == [1] and recorded.prep.dtype == "float32"
    defaults = OmegaConf.load(Path(__file__).parents[1] / "configs" / "prep" / "default.yaml")
    assert list(defaults.layers) == [] and defaults.dtype == "bfloat16"
    # as runs recorded before the cache's labels and features were
    recorded.labels, recorded.prep.layers, recorded.prep.dtype = "regenerate", [], "bfloat16"
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(recorded))
    main([*args, "train.max_steps=2", "resume=auto"])  # was refused: "labels: 'regenerate' -> 'teacher_forced'"
    assert sorted(p.name for p in (run_dir / "launches").glob("*.yaml")) == ["1.yaml"]
    assert OmegaConf.load(run_dir / "launches" / "1.yaml").labels == "teacher_forced"


def test_recorded_labels_other_than_the_old_default_must_not_change(tmp_path):
    """Only data prep's default, which offline runs recorded before they recorded their cache's, gives
    way to the cache's labels; a run recorded as trained on teacher-forced labels is refused a resume
    that trains on regenerated ones, naming the key."""
    from omegaconf import OmegaConf

    from core.config import UserInputError, compose
    from train.resume import check_resume_config

    run = tmp_path / "run"
    run.mkdir()
    assert compose([]).labels == "regenerate"
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["labels=teacher_forced"])))
    check_resume_config(compose(["labels=teacher_forced"]), run)
    with pytest.raises(UserInputError, match="labels: 'teacher_forced' -> 'regenerate'"):
        check_resume_config(compose(["labels=regenerate"]), run)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["labels=regenerate"])))
    check_resume_config(compose(["labels=teacher_forced"]), run)  # an older record: the default gives way


def test_a_missing_cache_names_the_settings_of_its_hash_and_the_caches_that_exist(tiny_model_dir, tmp_path, capsys):
    """The default cache folder is the hash of the cache-defining settings: a launch whose labels or
    data settings differ from data prep's looks elsewhere.  The error names the keys this launch
    sets, each cache under <output_root>/cache with the keys where it differs and whether it is
    complete, and the two ways out; nothing is written."""
    from core.config import compose, save_config
    from data_prep.cache import default_cache_dir
    from train.run import main

    common = [f"model.path={tiny_model_dir}", f"output_root={tmp_path}"]
    made = default_cache_dir(compose([*common, "labels=teacher_forced", "data.max_length=64"]))
    save_config(compose([*common, "labels=teacher_forced", "data.max_length=64"]), made)
    (made / "train").mkdir()
    (made / "train" / "manifest.json").write_text("{}")
    args = [*common, "heads=ctc", "labels=regenerate", "data.max_length=64", "train.run_name=r",
            "train.accelerator=cpu", "train.devices=1"]
    wanted = default_cache_dir(compose(args))
    with pytest.raises(SystemExit) as exc:
        main(args)
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and msg.startswith(f"error: no cache at {wanted} (no train/manifest.json).")
    # labels=regenerate is data prep's default, so not listed as set
    assert f"this launch sets data.max_length=64, model.path={tiny_model_dir}." in msg
    assert f"{made} (complete): labels=teacher_forced (here regenerate)." in msg
    assert "train.cache_dir=<a cache>" in msg
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", ["missing", "not_a_cache"])
def test_a_train_cache_dir_that_is_no_cache_is_named_before_the_base_loads(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                                         kind):
    """Before, the base loaded and the error said to 'set train.cache_dir', the key the user had just set."""
    import core.base_model
    from train.run import main

    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    cache = tmp_path / "cache"
    if kind == "not_a_cache":
        cache.mkdir()
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"output_root={tmp_path}", "heads=ctc", f"train.cache_dir={cache}",
              "train.accelerator=cpu", "train.devices=1"])
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    what = "no such folder" if kind == "missing" else "no train/manifest.json there (not a data-prep cache)"
    assert exc.value.code == 2 and msg.startswith(f"error: train.cache_dir={str(cache)!r}: {what}; pass the folder")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("head,keys,need", [
    ("eagle3", [], [2, 4, 5]),                       # EAGLE-3's default [2, L//2, L-3] of an 8-layer base
    ("eagle3", ["heads.layers=[1,3,6]"], [1, 3, 6]),
    ("adadecode", ["heads.layers=[1,2]"], [1, 2]),
])
def test_a_cache_without_the_heads_layers_is_refused_before_the_base_loads(tmp_path, capsys, monkeypatch, head, keys,
                                                                          need):
    """Before, the base's weights loaded (minutes for a real base) and the head was built before the
    cache's layers were compared with the ones the head reads."""
    import re

    import core.base_model
    from core.tiny import save_tiny_model
    from data_prep.synthetic import write_random_cache
    from train.run import main

    model_dir = save_tiny_model(tmp_path / "base8", seed=0, num_hidden_layers=8)
    cache = write_random_cache(tmp_path / "cache", model_dir, n_train=2, n_val=1, layers=[1])
    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={model_dir}", f"output_root={tmp_path}", f"heads={head}", *keys, f"train.cache_dir={cache}",
              "train.accelerator=cpu", "train.devices=1", "train.run_name=r"])
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    missing = [l for l in need if l != 1]
    flat = ",".join(map(str, need))
    assert exc.value.code == 2, msg
    assert re.fullmatch(rf"error: the {head} head reads hidden states hs\[{', '.join(map(str, missing))}\] but cache "
                        rf"{re.escape(str(cache))} holds layers \[1\]; prepare a cache with prep.layers=\[{flat}\] "
                        rf"\(python -m data_prep prep.layers=\[{flat}\] \.\.\.\)", msg), msg
    assert not (tmp_path / "runs").exists()


def test_a_cache_with_the_heads_layers_passes_the_early_check(tmp_path):
    """The early check reads the base's depth from its config and lets a cache holding the layers through."""
    from core.config import compose
    from core.tiny import save_tiny_model
    from data_prep.synthetic import write_random_cache
    from train.run import check_cache_layers_early

    model_dir = save_tiny_model(tmp_path / "base8", seed=0, num_hidden_layers=8)
    cfg = compose([f"model.path={model_dir}", "heads=eagle3"])
    check_cache_layers_early(cfg, [2, 4, 5], tmp_path)     # the defaults of an 8-layer base: held
    with pytest.raises(Exception, match=r"hs\[5\]"):
        check_cache_layers_early(cfg, [2, 4, 6], tmp_path)


@pytest.mark.parametrize("devices,cores,said", [(3, 2, True), ([0, 1, 2], 2, True), (2, 2, False), (-1, 2, False),
                                                (1, 1, False)])
def test_more_cpu_processes_than_cores_are_named(devices, cores, said):
    """``train.devices=3`` on 2 cores started 3 DDP processes without a word (a new user's trial)."""
    from train.strategies import cpu_oversubscription

    line = cpu_oversubscription(devices, cores=cores)
    assert (line is not None) == said
    if said:
        assert line == (f"train.devices=3 starts 3 CPU training processes on {cores} cores: they take turns on the "
                        f"cores (1 intra-op thread each); train.devices={cores} uses each core once")


def test_trainer_kwargs_say_the_cpu_oversubscription_once(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import os

    from core.config import compose
    from train.strategies import trainer_kwargs

    cores = len(os.sched_getaffinity(0))
    cfg = compose([f"model.path={tiny_model_dir}", f"output_root={tmp_path}", "train.accelerator=cpu",
                   f"train.devices={cores + 1}"])
    assert trainer_kwargs(cfg)["devices"] == cores + 1
    err = capsys.readouterr().err
    assert err.count(f"draftheads: train.devices={cores + 1} starts {cores + 1} CPU training processes") == 1, err


@pytest.mark.parametrize("damage", ["manifest", "label_counts", "last_ckpt", "flipped_ckpt"])
def test_a_damaged_cache_or_checkpoint_file_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys, damage):
    """A manifest.json that is not JSON, a torn label_counts.safetensors and a torn last.ckpt ended in
    tracebacks (JSONDecodeError, SafetensorError); each is now ``error: <file>: <reason>; <way out>``."""
    from data_prep.synthetic import write_random_cache
    from train.run import main

    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=4, n_val=2)
    args = [f"model.path={tiny_model_dir}", f"output_root={tmp_path}", "heads=ctc", "heads.attn_implementation=eager",
            f"train.cache_dir={cache}", "train.accelerator=cpu", "train.devices=1", "train.run_name=r",
            "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", "train.batch_size=2",
            "train.max_steps=4", "train.val_every_n_steps=2", "train.save_top_k=-1"]
    if damage == "manifest":
        victim = cache / "train" / "manifest.json"
        victim.write_text("{")
        way = r"not valid JSON \(Expecting property name enclosed in double quotes: line 1 column 2\); rerun data prep with the same settings to rewrite it \(its finished shards are kept\)"
    elif damage == "label_counts":
        from data_prep.label_counts import write_split_counts

        victim = cache / "train" / "label_counts.safetensors"
        write_split_counts(cache / "train")
        victim.write_bytes(victim.read_bytes()[:-10])
        args += ["heads.draft_vocab_size=100"]
        way = r"not a readable safetensors file \(.*\); delete it: the counts are scanned from the shards again"
    else:
        main(args)
        victim = tmp_path / "runs" / "ctc" / "r" / "checkpoints" / "last.ckpt"
        data = bytearray(victim.read_bytes())
        if damage == "last_ckpt":
            del data[len(data) // 2:]
        else:  # two bytes of the last tensor's data flipped: it still loads, as other numbers (it resumed before)
            data[-6] ^= 0xFF
            data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
        args += ["resume=auto"]
        why = r".*" if damage == "last_ckpt" else r"its contents differ from the SHA-256 recorded when it was written"
        way = rf"not a readable checkpoint \({why}.*\); resume from another checkpoint of the run \(resume=<its path>; " \
              r".* holds step0000002.ckpt, step0000004.ckpt\)"
        capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "Traceback" not in "\n".join(err), err
    assert re.fullmatch(rf"error: {re.escape(str(victim))}: {way}", err[-1]), err[-1]


def test_resume_of_another_runs_checkpoint_under_a_new_run_name_is_refused(tiny_model_dir, tmp_path, capsys):
    """``resume=<run a's checkpoint> train.run_name=b`` rewound run a and rewrote its last/ and best/, silently."""
    from data_prep.synthetic import write_random_cache
    from train.run import main

    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=4, n_val=2)
    args = [f"model.path={tiny_model_dir}", f"output_root={tmp_path}", "heads=ctc", "heads.attn_implementation=eager",
            f"train.cache_dir={cache}", "train.accelerator=cpu", "train.devices=1", "train.logger=csv",
            "train.progress_bar=false", "train.sanity_val_steps=0", "train.batch_size=2", "train.max_steps=4",
            "train.val_every_n_steps=2", "train.save_top_k=-1"]
    main([*args, "train.run_name=a"])
    run_a = tmp_path / "runs" / "ctc" / "a"
    before = {p: p.read_bytes() for p in run_a.rglob("*") if p.is_file()}
    capsys.readouterr()
    ckpt = run_a / "checkpoints" / "step0000002.ckpt"
    with pytest.raises(SystemExit) as exc:
        main([*args, "train.run_name=b", f"resume={ckpt}"])
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and msg == (f"error: resume={ckpt} continues the run in {run_a}, but train.run_name=b "
                                           f"names {run_a.parent / 'b'}: leave train.run_name out (or set it to a) to "
                                           "continue that run; a resume never starts another one")
    assert {p: p.read_bytes() for p in run_a.rglob("*") if p.is_file()} == before
    assert not (run_a.parent / "b").exists()
