"""The command line as a newcomer meets it: plain, instant help with defaults and a version;
a missing extra or a collector that cannot start is one clear line; any size parses; and
Ctrl-C stops the demo cleanly with its summary, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import weightsync
from weightsync.cli import main
from weightsync.units import format_duration, format_size, parse_size

COMMAND = [sys.executable, "-m", "weightsync.cli"]
#: runs argv[1:] with Ctrl-C as a terminal gives its foreground job: SIGINT at its default and
#: not blocked. A child inherits an ignored or blocked SIGINT across exec, and the test process
#: may have either from what ran in it before (a CI run once saw the demo train on, unstopped)
AS_A_FOREGROUND_JOB = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execv(sys.argv[1], sys.argv[1:])")


def _run(code: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, check=False, **kwargs)  # type: ignore[call-overload]


def test_help_imports_neither_torch_nor_tensordict():
    result = _run("""
        import sys
        from weightsync.cli import main
        for argv in (["--help"], ["demo", "--help"], ["bench", "--help"], ["--version"]):
            try:
                main(argv)
            except SystemExit:
                pass
        print("heavy:", sorted(m for m in ("torch", "tensordict", "rich", "matplotlib")
                               if m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout


def test_import_weightsync_and_a_scheme_without_tensordict():
    result = _run("""
        import sys
        import weightsync as ws
        assert "torch" not in sys.modules, "import weightsync alone imports torch"
        scheme = ws.SharedMemWeightSyncScheme(num_workers=1)
        ws.WeightStrategy(extract_as="state_dict").extract_weights({"w": __import__("torch").ones(2)})
        print("tensordict" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_tensordict_stays_a_supported_input():
    import torch
    from tensordict import TensorDict

    strategy = weightsync.WeightStrategy()
    td = TensorDict({"a": {"b": torch.ones(3)}}, batch_size=[])
    assert torch.equal(strategy.extract_weights(td)["a", "b"], torch.ones(3))
    model = torch.nn.Linear(2, 2)
    assert set(strategy.extract_weights(model).keys()) == {"weight", "bias"}


def test_help_is_plain_and_shows_defaults(capsys):
    for argv, defaults in ((["demo", "--help"], ["(default: shm)", "(default: 2)",
                                                 "(default: demo-output)", "(default: 0)"]),
                           (["bench", "--help"], ["(default: 1MB 400MB)", "(default: 1 2 4)"])):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = " ".join(capsys.readouterr().out.split())  # as read, whatever the wrapping
        assert "`" not in out
        for default in defaults:
            assert default in out, (default, out)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "`" not in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"weightsync {weightsync.__version__}"


@pytest.mark.parametrize("argv, missing, extra", [
    (["demo"], "gymnasium", "demo"),
    (["demo", "--transport", "ray"], "ray", "ray"),
    (["bench", "--transports", "shm", "--plot", "x.png"], "matplotlib", "demo"),
    (["bench", "--transports", "ray"], "ray", "ray"),
    (["bench", "--transports", "lora"], "peft", "lora"),
])
def test_missing_extra_is_one_line_saying_what_to_install(monkeypatch, capsys, argv, missing, extra):
    monkeypatch.setitem(sys.modules, missing, None)  # what an uninstalled module looks like
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert missing in err and f"pip install 'weightsync[{extra}]'" in err


def test_torchrl_collector_without_torchrl_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "weightsync.demo.torchrl", None)
    assert main(["demo", "--collector", "torchrl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'weightsync[torchrl]'" in err


@pytest.mark.parametrize("text, nbytes", [
    ("1MB", 10**6), ("400MB", 400 * 10**6), ("100MB", 10**8), ("2GB", 2 * 10**9),
    ("512KB", 512_000), ("1GiB", 1 << 30), ("1.5MiB", 3 << 19), ("4096", 4096), ("3 mb", 3 * 10**6),
])
def test_sizes_parse(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-1MB", "0KB", "1e3"])
def test_bad_sizes_are_refused_with_an_example(text):
    with pytest.raises(ValueError, match="512KB|at least 1 byte"):
        parse_size(text)


def test_bench_refuses_a_bad_size_before_measuring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--sizes", "12XB"])
    assert exit_info.value.code == 2
    assert "not a size: '12XB'" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, text", [
    (3.0, "3.0 s"), (0.00042, "0.42 ms"), (0.0421, "42.1 ms"), (0.35, "350 ms"),
    (3.5e-5, "35.0 µs"), (125.0, "2 min 5 s"), (float("nan"), "n/a"),
])
def test_durations_read_as_people_write_them(seconds, text):
    assert format_duration(seconds) == text


def test_sizes_format():
    assert format_size(400 * 10**6) == "400 MB" and format_size(512) == "512 B"


@pytest.mark.slow
def test_collector_failing_at_startup_is_reported_at_once_with_its_own_error(tmp_path):
    fake = tmp_path / "site" / "gymnasium"
    fake.mkdir(parents=True)  # importable for the up-front check, broken in the collectors
    (fake / "__init__.py").write_text("raise ImportError('gymnasium is broken on this host')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    result = subprocess.run(
        [*COMMAND, "demo", "--workers", "2", "--no-live", "--no-plot", "--max-iterations", "3"],
        capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"collector \d failed: ImportError: gymnasium is broken on this host",
                     result.stderr), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "not set up within" not in result.stderr  # its own error, not a timeout


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@pytest.mark.slow
def test_ctrl_c_during_the_demo_stops_cleanly_with_a_summary(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    demo = [*COMMAND, "demo", "--workers", "4", "--no-live", "--output-dir", str(tmp_path / "out")]
    inherited = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_A_FOREGROUND_JOB, *demo],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    lines = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "iteration    1 " in line:  # training: collectors and sender are all busy
                break
        assert any("iteration    1 " in line for line in lines), "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    output = "".join(lines) + out
    assert proc.returncode == 130, f"{output}{err}(this test's SIGINT handler and mask: {inherited})"
    assert "interrupted: CartPole-v1 over shm" in output, output + err
    assert "Traceback" not in output + err and "KeyboardInterrupt" not in output + err, err
    assert "lost" not in err and "sender closed" not in err, err  # goodbyes are not losses
    deadline = time.monotonic() + 20  # multiprocessing's resource tracker exits on its own
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(proc.pid) == []
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # nothing in the working directory
