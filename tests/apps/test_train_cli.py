"""``mcgraph train`` as a person uses it: Ctrl-C, ``--resume PATH`` alone, and the progress it shows.

* Ctrl-C is a real ``SIGINT`` sent to a real ``python -m mcgraph train`` process mid-epoch (or inside the
  checkpoint write, held open by ``MCGRAPH_ATOMIC_PAUSE_S``): one line on stderr naming the last checkpoint
  and the command that resumes it, exit status 130, no traceback, nothing half written.
* ``--resume PATH`` alone continues the run with the checkpoint's settings and ends bitwise where the
  uninterrupted run ends; a flag that contradicts the checkpoint is refused by name, one that agrees is
  accepted, and the run controls (``--epochs`` upwards, ``--threads``, ``--no-progress``, ...) may change.
* On a terminal (a pseudo-terminal from ``os.openpty``, with and without a window size) a tqdm bar is drawn;
  without tqdm, and into a pipe, the log is one plain line per epoch with no carriage-return redraws.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from support.child_env import child_env
from support.train_cli import run_main
from mcgraph.apps import atomic_io

pytestmark = pytest.mark.integration

pytest.importorskip("sklearn")

#: a small run whose epochs are quick (4 steps)
TINY = ["--model", "mlp", "--hidden", "8", "--dataset", "digits", "--batch-size", "128", "--limit-train", "512",
        "--limit-test", "64", "--kl-samples", "4", "--eval-samples", "2", "--periodic-eval-samples", "2",
        "--threads", "1"]
#: a run whose epochs last about a second (64 steps with a 200-sample Monte Carlo KL), long enough for a
#: SIGINT sent just after an epoch's log line to land inside the next epoch
SLOW = ["--model", "mlp", "--hidden", "16", "--dataset", "digits", "--batch-size", "8", "--limit-train", "512",
        "--limit-test", "64", "--kl-samples", "200", "--kl-method", "monte-carlo", "--eval-samples", "2",
        "--eval-every", "0", "--threads", "1", "--epochs", "3"]
#: the line a Ctrl-C prints after a checkpoint exists
INTERRUPTED = re.compile(r"^mcgraph train: interrupted (?P<doing>.+?); (?P<path>\S+) holds epoch (?P<done>\d+); "
                         r"resume with: mcgraph train --resume (?P<command_path>\S+)$")


def _sigint_default():  # runs in the child before exec: a shell may start background jobs with SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv: list, after: str, env: dict, delay: float = 0.0, timeout: float = 300.0):
    """Run ``python -m mcgraph train argv``; send SIGINT ``delay`` s after the first stderr line containing
    ``after``. Returns ``(exit status, stderr lines)``."""
    proc = subprocess.Popen([sys.executable, "-m", "mcgraph", "train", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    lines, sent = [], False
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if not sent and after in line:
                time.sleep(delay)
                proc.send_signal(signal.SIGINT)
                sent = True
            assert time.monotonic() < deadline, "\n".join(lines[-20:])
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent, f"never saw {after!r}:\n" + "\n".join(lines[-20:])
    return proc.returncode, lines


def _checkpoint(path: Path) -> dict:
    return atomic_io.load_checkpoint(path)[0]


def _same_parameters(a: Path, b: Path) -> None:
    x, y = _checkpoint(a), _checkpoint(b)
    assert x["epoch"] == y["epoch"] and x["step"] == y["step"]
    assert set(x["model"]) == set(y["model"])
    for key in x["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), key
    for key, state in x["optimizer"]["state"].items():
        assert all(torch.equal(state[k], y["optimizer"]["state"][key][k]) for k in state if torch.is_tensor(state[k]))


def _nothing_partial(out: Path) -> None:
    """Every file of the run folder is complete: no temporary file, the checkpoints load, the log parses."""
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    for version in [out / "checkpoint.pt"] + atomic_io.previous_versions(out / "checkpoint.pt"):
        _checkpoint(version)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


# --------------------------------------------------------------------------- Ctrl-C, then --resume alone


def test_ctrl_c_mid_epoch_prints_one_line_and_resume_alone_ends_bitwise_like_the_uninterrupted_run(tmp_path):
    """SIGINT just after epoch 1's log line (epoch 2 is under way): exit 130, no traceback, one line naming the
    checkpoint and ``mcgraph train --resume <path>``; that command, run as printed, ends with the parameters and
    Adam state of the uninterrupted 3-epoch run, bit for bit, in the same folder."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    code, lines = _interrupt(SLOW + ["--out", str(out)], after="epoch 1: loss", env=child_env(), delay=0.2)
    text = "\n".join(lines)
    print(f"\n[train-cli] Ctrl-C: exit {code}; last line: {lines[-1]}")
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert sum("interrupted" in line for line in lines) == 1, text
    match = INTERRUPTED.match(lines[-1])
    assert match, text
    done = int(match["done"])
    assert match["doing"] == f"in epoch {done + 1} of 3", text  # stopped inside an epoch, after a checkpoint
    assert match["path"] == match["command_path"] == str(out / "checkpoint.pt")
    assert _checkpoint(out / "checkpoint.pt")["epoch"] == done >= 1
    _nothing_partial(out)

    assert run_main(SLOW + ["--out", str(ref)]) == 0  # the uninterrupted run
    assert run_main(["--resume", match["command_path"]]) == 0  # the printed command
    _same_parameters(out / "checkpoint.pt", ref / "checkpoint.pt")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # the same run folder: its log goes on
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3


def test_ctrl_c_inside_the_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    """SIGINT while epoch 2's checkpoint is being written (its temporary file complete, ``os.replace`` not yet
    done): the write is abandoned, its temporary file removed, and checkpoint.pt still holds epoch 1, which the
    printed line names. The interrupted run was itself a ``--resume`` alone, with ``--epochs`` raised."""
    out = tmp_path / "run"
    assert run_main(TINY + ["--epochs", "1", "--out", str(out)]) == 0
    ckpt = out / "checkpoint.pt"
    before = ckpt.read_bytes()
    env = child_env(MCGRAPH_ATOMIC_PAUSE_S="60", MCGRAPH_ATOMIC_MATCH="checkpoint.pt")
    code, lines = _interrupt(["--resume", str(ckpt), "--epochs", "3"], after="paused before replacing", env=env)
    text = "\n".join(lines)
    assert code == 130, text
    assert "Traceback" not in text, text
    assert lines[-1] == (f"mcgraph train: interrupted in epoch 2 of 3; {ckpt} holds epoch 1; resume with: "
                         f"mcgraph train --resume {ckpt}"), text
    assert ckpt.read_bytes() == before
    _nothing_partial(out)


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    out = tmp_path / "run"
    argv = SLOW + ["--out", str(out)]
    code, lines = _interrupt(argv, after="batches/epoch", env=child_env(), delay=0.1)
    assert code == 130, "\n".join(lines)
    assert re.fullmatch(r"mcgraph train: interrupted (before training|in epoch 1 of 3), before the first checkpoint; "
                        r"nothing to resume", lines[-1]), lines
    assert not (out / "checkpoint.pt").exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------- --resume PATH: the stored settings


def test_resume_alone_takes_every_setting_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    """The run's settings are not mnist/lenet5 defaults: ``--resume`` alone trains the checkpoint's network on its
    dataset with its lr, seed and optimizer, in its folder (no new ``runs/`` folder)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = TINY + ["--optimizer", "vogn", "--lr", "5e-3", "--mc-samples", "2", "--seed", "4", "--epochs", "1",
                   "--no-progress", "--out", str(out)]
    assert run_main(argv) == 0
    assert run_main(["--resume", str(out / "checkpoint.pt"), "--epochs", "2"]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "--epochs 2 (checkpoint: 1)" in err, err
    state = _checkpoint(out / "checkpoint.pt")
    stored = state["args"]
    assert state["epoch"] == 2 and state["optimizer"]["counters"]["step"] == 8
    assert (stored["optimizer"], stored["lr"], stored["seed"], stored["mc_samples"], stored["dataset"]) == (
        "vogn", 5e-3, 4, 2, "digits")
    assert stored["out"] == str(out) and not (tmp_path / "runs").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer"] == "vogn" and [r["epoch"] for r in summary["history"]] == [1, 2]


def test_a_flag_that_contradicts_the_checkpoint_is_refused_by_name(tmp_path, capsys):
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    assert run_main(TINY + ["--epochs", "2", "--lr", "1e-3", "--out", str(out)]) == 0
    kept = ckpt.read_bytes()
    capsys.readouterr()
    # the whole command line again, with --lr changed: refused, not run with the new rate
    assert run_main(TINY + ["--epochs", "2", "--lr", "0.01", "--out", str(out), "--resume", str(ckpt)]) == 2
    assert "--lr 0.01 contradicts the checkpoint's lr 0.001" in capsys.readouterr().err
    refused = {
        ("--lr", "0.01"): "--lr 0.01 contradicts the checkpoint's lr 0.001",
        ("--seed", "1"): "--seed 1 contradicts the checkpoint's seed 0",
        ("--hidden", "16"): "--hidden 16 contradicts the checkpoint's hidden 8",
        ("--flipout",): "--flipout contradicts the checkpoint's flipout False",
        ("--dataset", "mnist"): "--dataset mnist contradicts the checkpoint's dataset digits",
        ("--optimizer", "adam"): "--optimizer adam contradicts the checkpoint's optimizer None",
        ("--epochs", "1"): "--epochs 1 is fewer than the 2 epochs the checkpoint holds",
        ("--out", str(tmp_path / "elsewhere")): f"contradicts the checkpoint's run folder {out}",
    }
    for flags, words in refused.items():
        assert run_main(["--resume", str(ckpt), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"checkpoint {ckpt}: " in err and words in err, (flags, err)
        assert "Traceback" not in err
    assert run_main(["--resume", str(ckpt), "--lr", "0.01", "--kl-samples", "5"]) == 2  # all of them, by name
    err = capsys.readouterr().err
    assert "--lr 0.01 contradicts" in err and "--kl-samples 5 contradicts the checkpoint's kl_samples 4" in err
    assert ckpt.read_bytes() == kept and not (tmp_path / "elsewhere").exists()


def test_flags_that_agree_and_run_controls_are_accepted(tmp_path, capsys):
    """Agreeing flags (the whole original command line, ``--lr`` spelt ``0.001``) are accepted; the run controls
    (more ``--epochs``, ``--threads``, ``--no-progress``, ``--keep-checkpoints``, ``--eval-samples``) may differ;
    ``--out`` naming the checkpoint's own folder is accepted."""
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    first = TINY + ["--epochs", "1", "--lr", "1e-3", "--out", str(out)]
    assert run_main(first) == 0
    argv = first[:first.index("--epochs")] + ["--lr", "0.001", "--epochs", "2", "--out", str(out) + "/"]
    assert run_main(argv + ["--resume", str(ckpt)]) == 0
    assert _checkpoint(ckpt)["epoch"] == 2
    assert run_main(["--resume", str(ckpt), "--epochs", "3", "--threads", "2", "--no-progress", "--keep-checkpoints",
                  "2", "--eval-samples", "3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "--threads 2 (checkpoint: 1)" in err and "--eval-samples 3 (checkpoint: 2)" in err, err
    state = _checkpoint(ckpt)
    assert state["epoch"] == 3 and state["args"]["lr"] == 1e-3 and state["args"]["keep_checkpoints"] == 2
    assert json.loads((out / "summary.json").read_text())["test"]["num_samples"] == 3


def test_a_layout_that_does_not_fit_this_launch_is_named_and_may_be_overridden(tmp_path, capsys):
    """A run made by 2 torchrun ranks with --data-parallel 2, resumed in one process: the stored layout does not
    fit and is named (no traceback); --data-parallel 1, a run control, overrides it."""
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pt"
    assert run_main(TINY + ["--epochs", "1", "--no-progress", "--out", str(out)]) == 0
    state = _checkpoint(ckpt)
    state["args"]["data_parallel"] = 2
    atomic_io.save_checkpoint(ckpt, state)
    capsys.readouterr()
    assert run_main(["--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "--data-parallel 2 (the checkpoint's) does not divide the 1 process(es) of this launch" in err, err
    assert run_main(["--resume", str(ckpt), "--data-parallel", "1", "--epochs", "2"]) == 0
    assert "--data-parallel 1 (checkpoint: 2)" in capsys.readouterr().err
    assert _checkpoint(ckpt)["epoch"] == 2


def test_sghmc_epochs_are_fixed_by_its_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(TINY + ["--optimizer", "adaptive-vb", "--avb-form", "sghmc", "--epochs", "1", "--no-progress",
                         "--out", str(out)]) == 0
    capsys.readouterr()
    assert run_main(["--resume", str(out / "checkpoint.pt"), "--epochs", "2"]) == 2
    assert "cyclical learning rate of --avb-form sghmc" in capsys.readouterr().err


# --------------------------------------------------------------------------- progress: a terminal, a pipe


def _on_pty(argv: list, size: tuple[int, int] | None, without_tqdm: bool = False,
            timeout: float = 300.0) -> tuple[int, str]:
    """Run ``mcgraph train argv`` with stdin, stdout and stderr on a new pseudo-terminal (``size``: (rows,
    columns) set on it; ``None``: the 0 x 0 of a bare ``openpty``). Returns (exit status, what it showed)."""
    controller, terminal = os.openpty()
    if size is not None:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    block = "import sys; sys.modules['tqdm'] = None; " if without_tqdm else ""  # `import tqdm` then fails
    code = block + "import sys; from mcgraph.__main__ import main; sys.exit(main(['train', *sys.argv[1:]]))"
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdin=terminal, stdout=terminal, stderr=terminal,
                            env=child_env(), close_fds=True)
    os.close(terminal)
    shown = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=60)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, shown.decode("utf-8", "replace")


#: a tqdm bar as it is drawn: "\repoch 1/2:  25%|██▌       | 1/4 [00:00<...]"
BAR = re.compile(r"\repoch [12]/2: +\d+%\|[^\r\n]*\| \d+/4 \[")


@pytest.mark.parametrize("size", [None, (30, 100)], ids=["no-window-size", "100x30"])
def test_a_terminal_shows_a_tqdm_bar(tmp_path, size):
    """On a terminal with tqdm installed each epoch draws a bar (also on a pseudo-terminal that reports no
    window size, where tqdm alone would draw nothing), cleared before the epoch's line."""
    pytest.importorskip("tqdm")
    code, shown = _on_pty(TINY + ["--epochs", "2", "--out", str(tmp_path / "run")], size)
    print(f"\n[train-cli] terminal {size or 'without a size'}: {shown[:300]!r}")
    assert code == 0, shown
    assert BAR.search(shown), shown
    assert {m.group(0)[:10] for m in BAR.finditer(shown)} == {"\repoch 1/2", "\repoch 2/2"}
    assert len(re.findall(r"epoch \d: loss", shown)) == 2  # the epoch lines, each after its bar is cleared


def test_a_terminal_without_tqdm_gets_plain_lines(tmp_path):
    code, shown = _on_pty(TINY + ["--epochs", "2", "--out", str(tmp_path / "run")], None, without_tqdm=True)
    assert code == 0, shown
    text = shown.replace("\r\n", "\n")  # the terminal turns each "\n" into "\r\n"
    assert "\r" not in text, repr(shown)
    assert [line for line in text.splitlines() if line.startswith("epoch")] == [
        line for line in text.splitlines() if re.match(r"epoch [12]: loss", line)]
    assert len(re.findall(r"^epoch \d+: loss", text, re.M)) == 2


def test_a_pipe_gets_one_plain_line_per_epoch(tmp_path):
    """stdout and stderr into pipes (a log file, CI): no bar, no carriage return, exactly one line per epoch,
    which carries the standard errors of the epoch's first step."""
    done = subprocess.run([sys.executable, "-m", "mcgraph", "train", *TINY, "--epochs", "3", "--kl-method",
                           "monte-carlo", "--out", str(tmp_path / "run")], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr + done.stdout
    epoch_lines = [line for line in done.stderr.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in epoch_lines] == ["epoch 1", "epoch 2", "epoch 3"], done.stderr
    assert all("kl_stderr" in line for line in epoch_lines), done.stderr
