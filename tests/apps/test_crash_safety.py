"""Training that loses nothing: real processes killed at seeded moments, torn and foreign checkpoints,
full disks, non-finite steps and dead ranks.

The fault-injection harness starts ``python -m mcgraph train`` on digits in a subprocess, sends
``SIGKILL`` at a seeded moment (a random time, just after an epoch's log line, or inside the
checkpoint write, which ``MCGRAPH_ATOMIC_PAUSE_S`` holds open between the complete temporary file
and ``os.replace``), checks that the checkpoint left behind loads, resumes with ``--resume PATH`` alone
(the settings come from the checkpoint), and at the end compares the parameters with an uninterrupted
run's, bit for bit. CI runs a chain of 3 kills on the ELBO
path; ``-m slow`` runs 30 kill points over every optimizer ``mcgraph train`` offers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from support.child_env import child_env
from support.train_cli import run_main
from mcgraph.apps import atomic_io
from mcgraph.apps import train as mtrain

pytestmark = pytest.mark.integration

pytest.importorskip("sklearn")

EPOCHS = 8
TINY = ["--model", "mlp", "--hidden", "8", "--dataset", "digits", "--batch-size", "128", "--limit-train", "512",
        "--limit-test", "64", "--kl-samples", "4", "--eval-samples", "2", "--periodic-eval-samples", "2",
        "--eval-every", "0", "--no-stderr", "--no-progress", "--threads", "1", "--epochs", str(EPOCHS)]
#: the training paths of ``mcgraph train`` (the ELBO with Adam, and each ``--optimizer``)
PATHS = {
    "elbo": [],
    "adam": ["--optimizer", "adam"],
    "vogn": ["--optimizer", "vogn", "--lr", "5e-3", "--mc-samples", "2"],
    "ivon": ["--optimizer", "ivon"],
    "adaptive-vb": ["--optimizer", "adaptive-vb", "--mc-samples", "2"],
    "sghmc": ["--optimizer", "adaptive-vb", "--avb-form", "sghmc", "--snapshots-per-cycle", "2"],
}


class Child:
    """``python -m mcgraph train ...`` in a subprocess; a thread collects its stderr lines."""

    def __init__(self, argv: list, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "mcgraph", "train", *argv], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.start = time.monotonic()
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, text: str, count: int, timeout: float = 120.0) -> bool:
        """Until ``count`` lines contain ``text`` (True) or the process ended first (False)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while sum(text in line for line in self.lines) < count:
                if self.proc.poll() is not None and not self.reader.is_alive():
                    return False
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {count} x {text!r} in {timeout} s:\n{''.join(self.lines)[-2000:]}")
                self.changed.wait(0.05)
        return True

    def kill(self) -> bool:
        """SIGKILL; True when the process was still running."""
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.join(10)
        return alive

    def finish(self, timeout: float = 300.0) -> int:
        self.proc.wait(timeout)
        self.reader.join(10)
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def _params(path: Path) -> tuple[dict, int]:
    state, _ = atomic_io.load_checkpoint(path)
    return state["model"], state["step"]


def _bitwise_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _reference(tmp_path: Path, name: str, extra: list) -> tuple[dict, int, float]:
    out = tmp_path / f"{name}-reference"
    child = Child(TINY + extra + ["--out", str(out)], child_env())
    assert child.finish() == 0, child.stderr[-3000:]
    model, step = _params(out / "checkpoint.pt")
    return model, step, time.monotonic() - child.start


def _kill_chain(tmp_path: Path, name: str, extra: list, kinds: list, rng: random.Random, wall: float,
                ref: dict, ref_step: int) -> dict:
    """Deliver one SIGKILL per entry of ``kinds``, each time resuming from what the killed run left; a run that
    ends before its kill is checked against the reference and the next kill starts a new run directory."""
    report = {"kills": [], "loads": 0, "finals": 0, "equal": 0}
    todo, attempts, chain = list(kinds), 0, 0
    out = tmp_path / f"{name}-killed-{chain}"
    while True:
        ckpt = out / "checkpoint.pt"
        kind = todo[0] if todo else None
        done_epochs = atomic_io.load_checkpoint(ckpt)[0]["epoch"] if ckpt.exists() else 0
        # a killed run resumes as a person would: `mcgraph train --resume PATH` alone
        argv = ["--resume", str(ckpt)] if ckpt.exists() else TINY + extra + ["--out", str(out)]
        env = child_env()
        if kind == "write":
            env.update(MCGRAPH_ATOMIC_PAUSE_S="0.5", MCGRAPH_ATOMIC_MATCH="checkpoint.pt")
        child = Child(argv, env)
        killed = False
        if kind is not None:
            attempts += 1
            remaining = max(1, EPOCHS - done_epochs)
            if kind == "time":
                moment = rng.uniform(0.3, wall)
                time.sleep(max(0.0, moment - (time.monotonic() - child.start)))
                where = f"at {moment:.2f} s"
            elif kind == "epoch":
                k, delay = rng.randint(1, remaining), rng.uniform(0.0, 0.03)
                child.wait_for(": loss ", k)  # the log line "epoch N: loss ..."
                time.sleep(delay)
                where = f"{delay:.3f} s after the log of epoch {done_epochs + k}"
            else:  # inside the checkpoint write: the temporary file is complete, os.replace not yet done
                k = rng.randint(1, remaining)
                child.wait_for("mcgraph-atomic: paused before replacing", k)
                where = f"inside the write of the checkpoint of epoch {done_epochs + k}"
            killed = child.kill()
        if killed:
            todo.pop(0)
            report["kills"].append(f"{kind}: {where}")
            if ckpt.exists():  # whatever the moment, the checkpoint on disk loads
                for version in [ckpt] + atomic_io.previous_versions(ckpt):
                    atomic_io.load_checkpoint(version)
                    report["loads"] += 1
            continue
        assert child.finish() == 0, child.stderr[-3000:]  # the run ended: compare, then start a new one
        model, step = _params(ckpt)
        report["finals"] += 1
        report["equal"] += int(_bitwise_equal(model, ref) and step == ref_step)
        if not todo or attempts > 3 * len(kinds):
            return report
        chain += 1
        out = tmp_path / f"{name}-killed-{chain}"


def _check_chain(tmp_path, name, kinds, seed):
    extra = PATHS[name]
    ref, ref_step, wall = _reference(tmp_path, name, extra)
    report = _kill_chain(tmp_path, name, extra, kinds, random.Random(seed), wall, ref, ref_step)
    print(f"\n[crash-safety] {name}: {len(report['kills'])} kills ({'; '.join(report['kills'])}); "
          f"{report['loads']} checkpoint loads after kills; {report['equal']} of {report['finals']} finished runs "
          f"bitwise equal to the uninterrupted run")
    assert len(report["kills"]) == len(kinds), "some kill points were never reached"
    assert report["equal"] == report["finals"], f"{name}: a resumed run's parameters differ from the uninterrupted run's"
    return report


def test_killed_three_times_resumes_bitwise(tmp_path):
    """CI version: the ELBO path killed after an epoch, inside the checkpoint write and at a random time."""
    _check_chain(tmp_path, "elbo", ["epoch", "write", "time"], seed=27)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATHS))
def test_killed_at_random_moments_resumes_bitwise_every_optimizer(tmp_path, name):
    """5 seeded kill points per training path (30 in all), at least one inside the checkpoint write."""
    rng = random.Random(f"kills-{name}")
    kinds = ["write"] + [rng.choice(["time", "epoch", "write"]) for _ in range(4)]
    rng.shuffle(kinds)
    _check_chain(tmp_path, name, kinds, seed=sorted(PATHS).index(name))


# --------------------------------------------------------------------------- a kill inside the write: before / after

_WRITER = r"""
import argparse, sys, torch
from pathlib import Path
from torch import nn
from mcgraph.apps import training_run

path, how, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(epoch)
model = nn.Linear(2048, 4096)
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(2, 2048)).sum().backward()
optimizer.step()
args = argparse.Namespace(seed=0)


def old_save_checkpoint(path, model, optimizer, epoch, step, args):  # mcgraph's writer before atomic_io, verbatim
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
                "args": vars(args)}, path)


print("writing", flush=True)
if how == "old":
    old_save_checkpoint(path, model, optimizer, epoch, epoch, args)
else:
    training_run.save_checkpoint(Path(path), model, optimizer, epoch, epoch, args)
print("done", flush=True)
"""


def _write_and_kill(path: Path, how: str, epoch: int, kill_when) -> bool:
    """Run the writer; SIGKILL it as soon as ``kill_when()`` holds. True when the kill landed mid-write."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), how, str(epoch)], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if kill_when():
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return proc.returncode == -signal.SIGKILL


def _write(path: Path, how: str, epoch: int) -> None:
    done = subprocess.run([sys.executable, "-c", _WRITER, str(path), how, str(epoch)], env=child_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _loads(path: Path):
    try:
        return torch.load(path, weights_only=True)["epoch"]
    except Exception as e:  # noqa: BLE001 - any failure is a lost checkpoint
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def test_kill_inside_the_checkpoint_write_old_code_loses_it_new_code_keeps_it(tmp_path):
    """Before: the in-place ``torch.save(state, path)`` of the old writer, killed while it writes, leaves a torn
    file and the previous checkpoint (epoch 1) is gone. After: ``save_checkpoint`` killed at the same moment
    (the temporary file half written) or inside its pause before ``os.replace`` leaves epoch 1 intact."""
    old = tmp_path / "old" / "checkpoint.pt"
    old.parent.mkdir()
    for _ in range(3):  # the kill must land while the 100 MB are being written
        _write(old, "old", 1)
        assert _loads(old) == 1
        size = old.stat().st_size
        if _write_and_kill(old, "old", 2, lambda: old.stat().st_size != size):
            break
    else:
        pytest.skip("the kill never landed inside the old writer's write")
    before = _loads(old)
    print(f"\n[crash-safety] old in-place torch.save killed mid-write: {old.stat().st_size} of {size} bytes "
          f"left, load -> {before}")
    assert before != 1 and before != 2  # torn: neither the previous checkpoint nor the new one

    new = tmp_path / "new" / "checkpoint.pt"
    new.parent.mkdir()
    _write(new, "new", 1)
    assert _loads(new) == 1
    temps = lambda: [p for p in new.parent.glob(".checkpoint.pt.*.tmp") if p.stat().st_size > 0]  # noqa: E731
    assert _write_and_kill(new, "new", 2, temps), "the kill did not land inside the atomic write"
    after = _loads(new)
    print(f"[crash-safety] atomic save_checkpoint killed mid-write: load -> epoch {after}")
    assert after == 1 and atomic_io.load_checkpoint(new)[0]["epoch"] == 1
    # and killed inside the pause between the complete temporary file and os.replace
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(new), "new", "3"],
                            env=child_env(MCGRAPH_ATOMIC_PAUSE_S="30"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert "paused before replacing" in proc.stderr.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _loads(new) == 1


# --------------------------------------------------------------------------- in-process runs of the CLI


def _tiny(out: Path, epochs: int, *extra) -> list:
    argv = list(TINY)
    argv[argv.index("--epochs") + 1] = str(epochs)
    return argv + ["--out", str(out), *extra]


def test_disk_full_and_permission_denied_keep_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    assert run_main(_tiny(out, 1)) == 0
    good = ckpt.read_bytes()
    for code in ("ENOSPC", "EACCES"):
        monkeypatch.setenv("MCGRAPH_ATOMIC_FAIL", code)
        monkeypatch.setenv("MCGRAPH_ATOMIC_MATCH", "checkpoint.pt")
        assert run_main(_tiny(out, 2, "--resume", str(ckpt))) == 2
        err = capsys.readouterr().err
        assert str(ckpt) in err and "unchanged" in err, err
        assert ("No space left" in err) if code == "ENOSPC" else ("Permission denied" in err)
        assert ckpt.read_bytes() == good and atomic_io.load_checkpoint(ckpt)[0]["epoch"] == 1
        assert not list(out.glob(".*.tmp"))  # the temporary file is removed
    monkeypatch.delenv("MCGRAPH_ATOMIC_FAIL")
    if os.geteuid() != 0:  # a real read-only directory (root writes anyway)
        out.chmod(0o555)
        try:
            assert run_main(_tiny(out, 2, "--resume", str(ckpt))) == 2
            err = capsys.readouterr().err
            assert str(out) in err and "Permission denied" in err, err
        finally:
            out.chmod(0o755)
        assert ckpt.read_bytes() == good


def test_pickled_payload_is_refused_and_does_not_run(tmp_path, capsys):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    evil = tmp_path / "evil.pt"
    good_args = _tiny(tmp_path / "run", 1)
    torch.save({"format": atomic_io.FORMAT, "model": Payload(), "optimizer": {}, "epoch": 0, "step": 0}, evil)
    assert run_main(good_args + ["--resume", str(evil)]) == 2
    err = capsys.readouterr().err
    assert str(evil) in err and "refused" in err, err
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is live: unsafe loading runs it
    assert marker.exists()


def test_torn_foreign_and_wrong_model_checkpoints_name_the_file(tmp_path, capsys):
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    assert run_main(_tiny(out, 1)) == 0
    cases = {}
    torn = tmp_path / "torn.pt"
    torn.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    cases[torn] = "not a complete torch checkpoint"
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    cases[foreign] = "not an mcgraph checkpoint"
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    cases[empty] = "empty"
    cases[tmp_path / "absent.pt"] = "no such file"
    stripped = tmp_path / "other-model.pt"
    state = atomic_io.load_checkpoint(ckpt)[0]
    state["model"] = {k: torch.zeros(3) for k in state["model"]}
    state.pop("format")
    atomic_io.save_checkpoint(stripped, state)
    cases[stripped] = "another model"
    for path, reason in cases.items():
        assert run_main(_tiny(path.parent, 2, "--resume", str(path))) == 2
        err = capsys.readouterr().err
        assert str(path) in err and reason in err, (path, err)
    # a checkpoint of another network (--hidden 16 resumed as --hidden 8): refused by name on the command line,
    # and by train() itself when it is handed settings that do not fit
    other = tmp_path / "wide"
    argv = _tiny(other, 1)
    argv[argv.index("--hidden") + 1] = "16"
    assert run_main(argv) == 0
    assert run_main(_tiny(other, 2, "--resume", str(other / "checkpoint.pt"))) == 2
    err = capsys.readouterr().err
    assert str(other / "checkpoint.pt") in err and "--hidden 8 contradicts the checkpoint's hidden 16" in err, err
    args = mtrain.build_parser().parse_args(_tiny(other, 2, "--resume", str(other / "checkpoint.pt")))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(atomic_io.CheckpointError, match=r"another run: hidden=\[16\]"):
            mtrain.train(args)
    finally:
        torch.set_num_threads(threads)


def test_resume_fallback_to_the_previous_checkpoint(tmp_path, capsys):
    """checkpoint.pt torn, checkpoint.pt.1 (the epoch before) kept: --resume refuses and names the file;
    --resume --resume-fallback continues from checkpoint.pt.1 and ends bitwise where the uninterrupted run does."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert run_main(_tiny(ref, 3)) == 0
    assert run_main(_tiny(out, 2)) == 0
    ckpt = out / "checkpoint.pt"
    assert atomic_io.previous_versions(ckpt) == [out / "checkpoint.pt.1"]  # --keep-checkpoints 1 by default
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    assert run_main(_tiny(out, 3, "--resume", str(ckpt))) == 2
    assert str(ckpt) in capsys.readouterr().err
    assert run_main(_tiny(out, 3, "--resume", str(ckpt), "--resume-fallback")) == 0
    err = capsys.readouterr().err
    assert "trying the previous checkpoint" in err and f"resumed from {ckpt}.1 at epoch 1" in err, err
    assert _bitwise_equal(_params(ckpt)[0], _params(ref / "checkpoint.pt")[0])


def test_keep_last_k_checkpoints(tmp_path):
    out = tmp_path / "run"
    assert run_main(_tiny(out, 4, "--keep-checkpoints", "2")) == 0
    ckpt = out / "checkpoint.pt"
    versions = [ckpt] + atomic_io.previous_versions(ckpt)
    assert [atomic_io.load_checkpoint(p)[0]["epoch"] for p in versions] == [4, 3, 2]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "checkpoint.pt.1", "checkpoint.pt.2",
                                                      "metrics.jsonl", "summary.json", "summary.md"]


# --------------------------------------------------------------------------- divergence


@pytest.mark.parametrize("term, words", [("kl", "KL term"), ("data", "data term")])
def test_nonfinite_term_stops_naming_step_and_term_without_writing(tmp_path, monkeypatch, capsys, term, words):
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    assert run_main(_tiny(out, 1)) == 0
    good, rows = ckpt.read_bytes(), (out / "metrics.jsonl").read_text()
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", f"6:{term}")  # step 6: the second step of epoch 2
    assert run_main(_tiny(out, 2, "--resume", str(ckpt))) == 3
    err = capsys.readouterr().err
    assert "step 6" in err and words in err, err
    assert ckpt.read_bytes() == good and (out / "metrics.jsonl").read_text() == rows


def test_nonfinite_step_skipped_with_the_flag(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", "3:kl")
    assert run_main(_tiny(out, 2, "--on-nonfinite", "skip")) == 0
    assert "step 3: non-finite loss; the step was skipped" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [1, 1]
    model, step = _params(out / "checkpoint.pt")
    assert step == 8 and all(bool(torch.isfinite(v).all()) for v in model.values())


def test_optimizer_path_stops_on_a_nonfinite_data_term(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", "3:data")
    assert run_main(_tiny(tmp_path / "run", 1, *PATHS["vogn"])) == 3
    err = capsys.readouterr().err
    assert "step 3: the data term is not finite" in err, err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


# --------------------------------------------------------------------------- torchrun: a rank killed mid-step


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"mcgraph" in cmd and pid != root:
            return pid
        todo += _children(pid)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchrun_rank_killed_mid_step_survivors_exit_with_an_error(tmp_path):
    out = tmp_path / "ddp"
    argv = _tiny(out, 200) + ["--dist-timeout", "30"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "mcgraph",
           "train", *argv]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:  # rank 0 logs each epoch
            lines.append(line)
            if "epoch 2: loss" in line:
                break
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None, "".join(lines)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - killed_at
    err = "".join(lines) + (rest or "")
    print(f"\n[crash-safety] torchrun: rank 1 killed; the run exited {proc.returncode} after {elapsed:.1f} s")
    assert proc.returncode != 0 and elapsed < 60, err[-3000:]
    assert "SIGKILL" in err or "exitcode" in err, err[-3000:]
    assert _rank_pid(proc.pid, 0) is None  # no rank left behind
    assert atomic_io.load_checkpoint(out / "checkpoint.pt")[0]["epoch"] >= 2  # rank 0's last checkpoint loads


def test_rank_killed_without_torchrun_agent_survivor_fails_within_the_timeout(tmp_path):
    """Two ranks started by hand (no agent to stop the survivor): rank 1 is killed mid-run; rank 0 ends with an
    error from the process group within --dist-timeout, never hangs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp"
    argv = _tiny(out, 200) + ["--dist-timeout", "20"]
    ranks = [Child(argv, child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(2)]
    try:
        assert ranks[0].wait_for("epoch 2: loss", 1), ranks[0].stderr[-3000:]
        ranks[1].kill()
        killed_at = time.monotonic()
        code = ranks[0].finish(timeout=90)
    finally:
        for child in ranks:
            child.kill()
    elapsed = time.monotonic() - killed_at
    print(f"\n[crash-safety] rank 1 killed; rank 0 exited {code} after {elapsed:.1f} s: "
          f"{ranks[0].stderr.strip().splitlines()[-1][:200]}")
    assert code == 4 and elapsed < 60
    assert "rank 0 of 2: the process group failed" in ranks[0].stderr
    assert atomic_io.load_checkpoint(out / "checkpoint.pt")[0]["epoch"] >= 2
