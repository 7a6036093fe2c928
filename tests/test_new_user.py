"""What a new user hits first (issue 31 items 1, 3, 4, 7, 8): training without a W&B login, a
damaged cache shard, a base of the same shape with other weights, Ctrl-C in training, and
``demo.sh --help``."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from core.config import UserInputError, compose

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(home: Path) -> dict[str, str]:
    """The environment of a user who never used W&B: no WANDB_* / NETRC, HOME an empty directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("NETRC",)}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(home / ".config")})
    return env


def _train_args(model_dir, cache, out, *extra) -> list[str]:
    return [f"model.path={model_dir}", "model.dtype=float32", "heads=ctc", "heads.attn_implementation=eager",
            "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={out}", f"train.cache_dir={cache}",
            "train.accelerator=cpu", "train.devices=1", "train.batch_size=4", *extra]


@pytest.fixture(scope="module")
def small_cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("nu") / "cache", tiny_model_dir, n_train=8, n_val=4,
                              length_range=(6, 14))


# ---------------------------------------------------------------- item 1: W&B without a login
def test_train_without_a_wandb_login_trains_and_writes_an_offline_run(tiny_model_dir, small_cache, tmp_path):
    """``python -m train`` as a new user starts it: no W&B variable, no login anywhere, stdin not a
    terminal.  Was: wandb.errors.UsageError "No API key configured" (the credential probe started
    wandb's session before WANDB_MODE was set, so wandb went to its login step)."""
    out = tmp_path / "out"
    args = _train_args(tiny_model_dir, small_cache, out, "train.logger=wandb", "train.run_name=w",
                       "train.max_steps=2", "train.val_every_n_steps=2")
    proc = subprocess.run([sys.executable, "-m", "train", *args], env=_clean_env(tmp_path / "home"), cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "No API key" not in text
    lines = [line for line in text.splitlines() if line.startswith("draftheads: W&B")]
    assert len(lines) == 1 and lines[0].startswith("draftheads: W&B offline (no W&B login found"), lines
    run_dir = out / "runs" / "ctc" / "w"
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert (run_dir / "best" / "model.safetensors").is_file()


@pytest.fixture
def no_login(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(key, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.chdir(tmp_path)
    return home


def test_wandb_mode_decision_from_key_netrc_settings_and_env(no_login, monkeypatch, tmp_path):
    from train.wandb_mode import decide_wandb_mode

    d = decide_wandb_mode()
    assert (d.mode, d.offline) == ("offline", True) and "no W&B login found" in d.reason
    assert "wandb sync" in d.line(tmp_path / "run")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # a fake key: nothing is sent anywhere
    d = decide_wandb_mode()
    assert (d.mode, d.reason) == ("online", "credentials from WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's WANDB_MODE wins over a key
    assert decide_wandb_mode().mode == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = no_login / ".netrc"  # what `wandb login` writes
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    netrc.chmod(0o600)
    d = decide_wandb_mode()
    assert d.mode == "online" and str(netrc) in d.reason
    monkeypatch.setenv("WANDB_MODE", "online")  # online asked for, with a login: obeyed
    assert decide_wandb_mode().mode == "online"
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "wandb").mkdir()  # `wandb disabled` in this directory wins over the login
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = disabled\n")
    assert decide_wandb_mode().mode == "disabled"
    netrc.unlink()  # online asked for without any login: one clear refusal, never wandb's prompt or traceback
    monkeypatch.setenv("WANDB_MODE", "online")
    from core.config import UserInputError

    with pytest.raises(UserInputError, match="WANDB_MODE=online but no W&B login was found.*wandb login"):
        decide_wandb_mode()
    # a mistyped mode: wandb raised a pydantic traceback at wandb.init, after the run folder was made
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(UserInputError, match=r"WANDB_MODE='ofline' is not a W&B mode \(Input should be 'online', "
                                             r"'offline'.*\); unset it"):
        decide_wandb_mode()
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's own older names still pass
    assert decide_wandb_mode().mode == "dryrun"


def test_wandb_logger_gets_the_mode_explicitly(no_login, tmp_path, capsys):
    """wandb.init receives mode=... (an already started wandb session ignores a later WANDB_MODE and
    would ask for a login), and the decision is one line."""
    from train.run import build_loggers

    lg = build_loggers(compose(["train.logger=wandb", f"output_root={tmp_path}"]), tmp_path / "run")[1]
    assert lg._wandb_init["mode"] == "offline" and lg._offline
    err = capsys.readouterr().err
    assert err.count("draftheads: W&B offline") == 1


# ---------------------------------------------------------------- item 3: shards checked against the manifest
def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_split_sizes_always_hashes_once_per_file_version(tiny_model_dir, tmp_path, monkeypatch):
    import data_prep.verify as V
    from data_prep.synthetic import write_random_cache

    cache = write_random_cache(tmp_path / "c", tiny_model_dir, n_train=6, n_val=2, shard_size=2)
    split = cache / "train"
    before = sorted(p.name for p in split.iterdir())
    calls = []
    real = V.sha256_file
    monkeypatch.setattr(V, "sha256_file", lambda p: calls.append(Path(p).name) or real(p))
    assert V.verify_split(split, stamp_dir=tmp_path / "stamps").hashed == 3  # below STAMP_MIN_BYTES: no stamp
    assert V.verify_split(split, stamp_dir=tmp_path / "stamps").hashed == 3 and not (tmp_path / "stamps").exists()
    monkeypatch.setattr(V, "STAMP_MIN_BYTES", 0)  # as for a large cache
    calls.clear()
    assert V.verify_split(split, stamp_dir=tmp_path / "stamps").hashed == 3 and len(calls) == 3
    calls.clear()
    r = V.verify_split(split, stamp_dir=tmp_path / "stamps")  # a resume: the stamp vouches for the unchanged files
    assert (r.hashed, r.stamped, calls) == (0, 3, [])
    assert r.stamp.parent == tmp_path / "stamps" and sorted(p.name for p in split.iterdir()) == before
    shard = split / "shard-00001.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # touched: hashed again
    assert V.verify_split(split, stamp_dir=tmp_path / "stamps").hashed == 1 and calls == [shard.name]
    assert V.verify_split(split, full=True, stamp_dir=tmp_path / "stamps").hashed == 3  # train.verify_cache=full
    # a shard changed in place is refused, naming it
    _flip_byte(shard)
    with pytest.raises(V.CacheIntegrityError, match=r"shard-00001\.safetensors does not match its manifest.*sha256"):
        V.verify_split(split, stamp_dir=tmp_path / "stamps")
    # a truncated shard is refused by its size, whatever the stamp says
    shard0 = split / "shard-00000.safetensors"
    shard0.write_bytes(shard0.read_bytes()[:-1])
    with pytest.raises(V.CacheIntegrityError, match=r"shard-00000\.safetensors has \d+ bytes but its manifest"):
        V.verify_split(split, stamp_dir=tmp_path / "stamps")


def test_damaged_cache_shard_is_refused_and_data_prep_rebuilds_it_saying_so(tiny_base, tiny_model_dir, tmp_path,
                                                                            capsys):
    """A shard damaged after data prep: training refuses it, naming the shard and the data prep
    command that rebuilds it; that command replaces the shard with one warning line (was: NaN
    training and a silent repair)."""
    from data_prep.__main__ import main as prep_main
    from train.run import train

    data = tmp_path / "data.json"
    words = "the quick brown fox jumps over a lazy dog again and again".split()
    data.write_text(json.dumps([{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(words[i % 5:i % 5 + 3])},
        {"from": "gpt", "value": " ".join(words[(2 * i) % 7:(2 * i) % 7 + 4])}]} for i in range(12)]))
    cache = tmp_path / "mycache"
    prep = [f"model.path={tiny_model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
            f"data.path={data}", "data.max_conversations=null", "data.heldout_fraction=0.25", "data.max_length=64",
            "prep.shard_size=4", "prep.progress=false", "labels=teacher_forced", f"prep.cache_dir={cache}",
            f"output_root={tmp_path / 'out'}"]
    prep_main(prep)
    shard = cache / "train" / "shard-00001.safetensors"
    good = shard.read_bytes()
    _flip_byte(shard, len(good) // 2)  # inside a hidden-state tensor: the file still loads
    capsys.readouterr()
    args = ["train.logger=none", "train.progress_bar=false", f"output_root={tmp_path / 'out'}",
            f"train.cache_dir={cache}", "train.run_name=x", "train.max_steps=1", "train.sanity_val_steps=0"]
    with pytest.raises(UserInputError) as exc:
        train(compose(args), base=tiny_base)
    message = str(exc.value)
    assert str(shard) in message and "does not match its manifest" in message
    assert not (tmp_path / "out" / "runs").exists()  # refused before the run directory exists
    command = message.split("rebuild it with `", 1)[1].split("`", 1)[0]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "data_prep"] and f"prep.cache_dir={cache}" in argv
    prep_main(argv[3:])  # the command as printed
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "warning: data prep" in line]
    assert len(warned) == 1 and str(shard) in warned[0] and "replacing it" in warned[0]
    assert shard.read_bytes() == good  # rebuilt byte for byte
    result = train(compose(args), base=tiny_base)
    assert result["trainer"].global_step == 1


# ---------------------------------------------------------------- item 4: base identity by content
def test_base_of_the_same_shape_with_other_weights_is_refused(tiny_base, tiny_model_dir, tmp_path):
    from dataclasses import replace

    from core.base_model import check_same_base, load_base_model
    from core.tiny import save_tiny_model
    from data_prep.synthetic import write_random_cache
    from train.run import _cache_datamodule, train

    other_dir = save_tiny_model(tmp_path / "other", seed=1)  # same shape, other weights
    model_b, tok_b, id_b = load_base_model({"path": str(other_dir), "dtype": "float32", "attn_implementation": "eager"})
    id_a = tiny_base[2]
    assert id_a.sha256 is None and id_b.sha256 is None  # HF folders: no GGUF digest
    assert id_a.weights_sha256 and id_b.weights_sha256 and id_a.weights_sha256 != id_b.weights_sha256
    assert {k: v for k, v in id_a.to_dict().items() if k not in ("source", "weights_sha256")} == \
        {k: v for k, v in id_b.to_dict().items() if k not in ("source", "weights_sha256")}
    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=2, n_val=1)
    assert json.loads((cache / "train" / "manifest.json").read_text())["base"]["weights_sha256"] == id_a.weights_sha256
    args = ["train.logger=none", "train.progress_bar=false", f"output_root={tmp_path}", f"train.cache_dir={cache}",
            "train.run_name=x", "train.max_steps=1"]
    with pytest.raises(UserInputError, match=r"made with another base model .*weights_sha256: .*train.allow_other_base"):
        train(compose(args), base=(model_b, tok_b, id_b))
    dm = _cache_datamodule(compose(args + ["train.allow_other_base=true"]), tok_b, id_b.to_dict())
    assert len(dm.train_reader) == 2
    # a head's config.json records it too, and evaluation compares it
    import heads
    from evaluation.runner import build_decoder

    ckpt = tmp_path / "head"
    heads.save(heads.build(compose(["heads=ctc"]).heads, tiny_base[0]), ckpt, id_a.to_dict())
    assert json.loads((ckpt / "config.json").read_text())["base"]["weights_sha256"] == id_a.weights_sha256
    ev = compose(["heads=ctc", f"eval.checkpoint={ckpt}"])
    with pytest.raises(UserInputError, match=r"head checkpoint .* another base model .*weights_sha256"):
        build_decoder(ev, model_b, [0], torch.device("cpu"), identity=id_b)
    # old records (before weights_sha256) that carry the GGUF SHA-256 still load, and are still compared by it
    old = {k: v for k, v in replace(id_a, sha256="g" * 64).to_dict().items() if k != "weights_sha256"}
    assert check_same_base(old, replace(id_a, sha256="g" * 64).to_dict(), "cache", "train.allow_other_base") == []
    with pytest.raises(UserInputError, match="sha256: g{64} -> h{64}"):
        check_same_base(old, replace(id_a, sha256="h" * 64).to_dict(), "cache", "train.allow_other_base")


def test_weights_digest_is_the_content_not_the_file_layout(tiny_model_dir, tmp_path, monkeypatch):
    """Re-sharded weights have the same identity; a GGUF-converted folder (source.json) carries the
    GGUF's SHA-256 too, so the GGUF route and the folder route agree; large files are hashed once."""
    import shutil

    import core.weights_digest as W
    from core.base_model import load_base_model, resolve_model_dir
    from transformers import AutoModelForCausalLM

    base = W.weights_sha256(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert W.weights_sha256(tmp_path / "sharded") == base
    with torch.no_grad():
        model.model.norm.weight[0] += 1.0  # one weight of the same shape differs
    model.save_pretrained(tmp_path / "changed")
    assert W.weights_sha256(tmp_path / "changed") != base
    converted = tmp_path / "converted"
    shutil.copytree(tiny_model_dir, converted)
    (converted / "source.json").write_text(json.dumps({"gguf": "/x/model.gguf", "sha256": "c" * 64}))
    assert resolve_model_dir({"path": str(converted)})[2] == "c" * 64
    ident = load_base_model({"path": str(converted), "dtype": "float32"})[2]
    assert (ident.sha256, ident.weights_sha256) == ("c" * 64, base)
    # the per-file cache: a second digest reads no tensor, a rewritten file is hashed again
    monkeypatch.setattr(W, "CACHE_MIN_BYTES", 0)
    reads = []
    real = W._safetensors_lines
    monkeypatch.setattr(W, "_safetensors_lines", lambda p: reads.append(p) or real(p))
    assert W.weights_sha256(converted, tmp_path / "dc") == base and len(reads) == 1
    assert W.weights_sha256(converted, tmp_path / "dc") == base and len(reads) == 1
    f = converted / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert W.weights_sha256(converted, tmp_path / "dc") == base and len(reads) == 2


# ---------------------------------------------------------------- item 7: Ctrl-C saves and says how to resume
def test_ctrl_c_saves_last_and_prints_the_resume_command(tiny_model_dir, small_cache, tmp_path):
    from safetensors.torch import load_file

    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.resume import resolve_resume
    from train.run import run_dir_for

    out = tmp_path / "out"
    args = _train_args(tiny_model_dir, small_cache, out, "train.logger=csv", "train.max_steps=100000",
                       "train.val_every_n_steps=100000")
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], env=_clean_env(tmp_path / "home"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 240
    while not any("Trainable params" in line for line in lines) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # a few optimizer steps into training
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    reader.join(timeout=10)
    text = "".join(lines)
    assert rc == 128 + signal.SIGINT, text[-3000:]
    assert "Ctrl-C again aborts" in text
    resume = [line for line in text.splitlines() if line.startswith("resume with: ")]
    assert len(resume) == 1, text[-3000:]
    argv = shlex.split(resume[0][len("resume with: "):])
    assert argv[1:3] == ["-m", "train"] and argv[-1] == "resume=auto"
    cfg = compose(argv[3:])
    run_dir = next((out / "runs" / "ctc").iterdir())
    assert cfg.train.run_name == run_dir.name  # resume=auto finds this run, not a newer one
    ckpt, resumed_dir = resolve_resume(cfg, run_dir_for)
    assert resumed_dir == run_dir and ckpt == run_dir / "checkpoints" / "last.ckpt"
    state = SafetensorsCheckpointIO().load_checkpoint(ckpt)
    step = int(state["global_step"])
    assert step >= 1 and f"after optimizer step {step}:" in text
    last = json.loads((run_dir / "last" / "config.json").read_text())["extra"]
    assert last["global_step"] == step
    exported = load_file(run_dir / "last" / "model.safetensors")
    in_ckpt = {k[len("head."):]: v for k, v in state["state_dict"].items() if k.startswith("head.")}
    assert exported.keys() <= in_ckpt.keys()
    for k, v in exported.items():
        assert torch.equal(v, in_ckpt[k]), k
    assert (run_dir / "best" / "model.safetensors").is_file()


def test_a_second_ctrl_c_aborts_at_once_and_other_signals_keep_the_interrupt():
    from train.resume import Preemption

    p = Preemption(checkpoint=None)
    p._handler(signal.SIGINT, None)  # first: only recorded
    assert p.received == signal.SIGINT
    p._handler(signal.SIGTERM, None)  # a later SIGTERM keeps the interrupt (its exports)
    assert p.received == signal.SIGINT
    old = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            p._handler(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)
    q = Preemption(checkpoint=None)
    q._handler(signal.SIGTERM, None)
    q._handler(signal.SIGUSR1, None)
    assert q.received == signal.SIGUSR1  # pre-emption signals as before: the latest wins


# ---------------------------------------------------------------- item 8: demo.sh --help
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_demo_help_prints_its_usage_and_runs_nothing(tmp_path, flag):
    log = tmp_path / "calls"
    fake = tmp_path / "py"
    fake.write_text(f"#!/usr/bin/env python3\nimport sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv) + '\\n')\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "data.max_conversations=5", flag],
                          env={**os.environ, "PY": str(fake)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: bash scripts/demo.sh") and "key=value" in proc.stdout
    assert "demo done" not in proc.stdout and not log.exists()
