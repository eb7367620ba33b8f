"""Weight sync through shared memory (issue 31): where `weight_sync` puts the versions, how `eopd
run` makes `auto` concrete on this machine, and the owner-only directory the learner publishes into
(its name in world-writable /dev/shm could be taken first by another local user). End to end: the
tiny run's tests in test_run_e2e.py (the mapped buffer by default, shm files or disk when configured)."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from eopd_trainer.config import load_config
from eopd_trainer.config.sections import shm_weights_dir
from eopd_trainer.job import weight_sync
from eopd_trainer.job.weight_sync import broadcast_here, choose_weight_sync, mapped_bytes_needed, release_shm
from eopd_trainer.queue.weights import WeightsDirUnsafe, ensure_private_dir
from tests.procs import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_weights_dir_follows_weight_sync(tmp_path):
    disk = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "weight_sync=disk"])
    auto = load_config(TINY, [f"run_dir={tmp_path / 'run'}"])
    shm = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "weight_sync=shm"])
    assert load_config(TINY, [f"run_dir={tmp_path / 'run'}", "weight_sync=mapped"]).weights_dir == shm.weights_dir
    assert disk.weights_dir == auto.weights_dir == tmp_path / "run" / "weights"  # auto reads as disk until eopd run decides
    assert shm.weights_dir == shm_weights_dir(tmp_path / "run")
    assert str(shm.weights_dir).startswith(f"/dev/shm/eopd-{os.getuid()}-") and shm.weights_dir.name == "weights"
    assert shm_weights_dir(tmp_path / "run") != shm_weights_dir(tmp_path / "other")  # one per run directory
    assert shm_weights_dir(tmp_path / "run") == shm_weights_dir(tmp_path / "x" / ".." / "run")  # by real path


def test_the_broadcast_gets_an_address_and_its_one_worker_under_eopd_run(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "weight_sync=broadcast", "weight_broadcast.workers=3"])
    assert cfg.weights_dir == tmp_path / "run" / "weights"  # the files of the fallback
    assert choose_weight_sync(cfg) == ("broadcast", "weight_sync: broadcast (configured)")
    here = broadcast_here(cfg.weight_broadcast)
    host, port = here.address.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536 and here.workers == 1  # eopd run starts one worker
    named = load_config(TINY, ["weight_sync=broadcast", "weight_broadcast.address=learner:29600"])
    assert broadcast_here(named.weight_broadcast).address == "learner:29600"
    with pytest.raises(Exception, match="weight_broadcast.backend"):
        load_config(TINY, ["weight_broadcast.backend=mpi"])


def test_auto_is_shared_memory_where_there_is_room(tmp_path, monkeypatch):
    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}"])
    root = tmp_path / "shm"
    root.mkdir()
    # the mapped buffer, whoever samples: transformers workers copy it out, vLLM's workers too (vllm_mapped.py)
    assert choose_weight_sync(cfg, shm_root=root) == ("mapped", f"weight_sync auto: one mapped buffer in shared memory "
                                                               f"({shm_weights_dir(tmp_path / 'run').parent})")
    for extra in ("student.device=cuda", "rollout.engine=vllm"):
        assert choose_weight_sync(load_config(TINY, [f"run_dir={tmp_path / 'run'}", extra]), shm_root=root)[0] == "mapped"
    assert choose_weight_sync(cfg, shm_root=tmp_path / "missing") == ("disk", f"weight_sync auto: disk ({tmp_path / 'missing'} is not available here)")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(weight_sync.shutil, "disk_usage", lambda _p: usage(1 << 40, 0, mapped_bytes_needed(cfg) - 1))
    sync, why = choose_weight_sync(cfg, shm_root=root)
    assert sync == "disk" and "GiB needed" in why
    assert choose_weight_sync(load_config(TINY, ["weight_sync=shm"]), shm_root=root) == ("shm", "weight_sync: shm (configured)")


def test_the_buffers_room_is_counted_from_the_student_files(tmp_path):
    model = tmp_path / "student"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    assert mapped_bytes_needed(load_config(TINY, [f"student.model={model}"])) == 2 * 1000
    assert mapped_bytes_needed(load_config(TINY)) == 2 * weight_sync.UNKNOWN_MODEL_BYTES  # a preset: not known here


def test_private_dir_is_created_owner_only_and_foreign_ones_are_refused(tmp_path):
    mine = ensure_private_dir(tmp_path / "mine")
    assert (os.stat(mine).st_mode & 0o777) == 0o700 and ensure_private_dir(mine) == mine  # again: accepted
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(WeightsDirUnsafe, match="mode 755, others can enter it"):
        ensure_private_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(WeightsDirUnsafe, match="not a directory"):
        ensure_private_dir(link)
    if os.getuid() == 0:  # a directory another user created first (root can hand it to nobody)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(WeightsDirUnsafe, match="owned by uid 65534, not by this user"):
            ensure_private_dir(theirs)


def test_release_removes_the_runs_shm_directory_only(tmp_path):
    run_dir = tmp_path / "run"
    target = shm_weights_dir(run_dir)
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    other = shm_weights_dir(tmp_path / "other")
    try:
        ensure_private_dir(target.parent)
        target.mkdir()
        (target / "v000001.safetensors").write_bytes(b"x")
        ensure_private_dir(other.parent)
        release_shm(run_dir)
        assert not target.parent.exists() and other.parent.exists()
        release_shm(run_dir)  # nothing there: fine
    finally:
        shutil.rmtree(target.parent, ignore_errors=True)
        shutil.rmtree(other.parent, ignore_errors=True)
