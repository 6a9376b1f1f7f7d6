"""`Engine()` by default drives the server's scheduler and detokenizer processes over ZMQ: same results
as the in-process scheduler, no processes left behind, and it works from any kind of script."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from serve import Engine
from tests.helpers import greedy

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import still_running  # noqa: E402

# SmolLM2 engines with scheduler and detokenizer processes (~10 s to start), scripts in subprocesses.
pytestmark = pytest.mark.slow

SETTINGS = dict(dtype="float32", max_running_requests=8, chunked_prefill_size=128, context_length=512,
                max_total_tokens=4096)  # the smollm2_engine fixture's, so compiled programs are shared


@pytest.fixture(scope="module")
def process_engine(smollm2_gguf):
    engine = Engine(model=smollm2_gguf, **SETTINGS)
    yield engine
    procs = list(engine._backend.children.procs.values())
    engine.shutdown()
    assert all(p.poll() is not None for p in procs), "child processes survived shutdown"


def test_chat_answers_paris(process_engine):
    out = process_engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                              sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_same_outputs_and_logprobs_as_in_process(process_engine, smollm2_engine):
    prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
    params = greedy(20)
    kwargs = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    ours = process_engine.generate(prompt=prompts, sampling_params=params, **kwargs)
    ref = smollm2_engine.generate(prompt=prompts, sampling_params=params, **kwargs)
    for a, b in zip(ours, ref):
        assert a["output_ids"] == b["output_ids"]
        assert a["text"] == b["text"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = a["meta_info"][key], b["meta_info"][key]
            assert [t for _, t in got] == [t for _, t in want]
            diffs = [abs(x - y) for (x, _), (y, _) in zip(got, want) if x is not None]
            assert max(diffs) < 1e-4, max(diffs)
        assert len(a["meta_info"]["output_top_logprobs"]) == 20


def test_stop_string_trimmed_and_bad_request_refused(process_engine):
    base = process_engine.generate(prompt="The alphabet starts with A, B, C,",
                                   sampling_params={"temperature": 0, "max_new_tokens": 16})
    words = base["text"].split()
    stop = words[1]
    out = process_engine.generate(prompt="The alphabet starts with A, B, C,",
                                  sampling_params={"temperature": 0, "max_new_tokens": 16, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == base["text"][: base["text"].find(stop)]
    with pytest.raises(ValueError, match="exceeds the limit"):
        process_engine.generate(input_ids=[5] * 600, sampling_params={"max_new_tokens": 4})
    assert process_engine.server_info()["free_tokens"] == 4096


# The README's example, with the test suite's settings (compiled programs are shared) and tiny generations.
README_EXAMPLE = f"""\
from serve import Engine
engine = Engine(**{SETTINGS!r})
out = engine.chat([{{"role": "user", "content": "What is the capital of France?"}}],
                  sampling_params={{"temperature": 0, "max_new_tokens": 8}})
print(out["text"])
outs = engine.generate(prompt=["Hello", "Once upon a time"], sampling_params={{"max_new_tokens": 4}})
print(len(outs))
engine.shutdown()
"""


def _run_script(cmd: list[str], cwd: str, stdin=None, timeout: float = 300) -> tuple[int, str, str]:
    """Runs `cmd` to completion; returns its exit code, stdout and stderr, having checked that it started
    child processes and that none of them outlives it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=stdin, stdout=out, stderr=err, text=True)
        children: dict[int, psutil.Process] = {}
        deadline = time.monotonic() + timeout
        while proc.poll() is None:  # note every child it starts, to check afterwards that they are gone
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the script did not finish in {timeout} s")
            with contextlib.suppress(psutil.NoSuchProcess):
                children.update((c.pid, c) for c in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.1)
        alive = still_running(list(children.values()), timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        assert not alive, f"children left behind: {[p.pid for p in alive]}"
        assert len(children) >= 2, "the engine started no child processes"
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_readme_example_without_main_guard(tmp_path, smollm2_gguf, how):
    """`python demo.py` and `python - < demo.py` (multiprocessing's spawn re-ran such a script in each
    child and failed); the "stdin" variant also forgets `engine.shutdown()`, which exit must then do."""
    script = tmp_path / "demo.py"
    text = README_EXAMPLE if how == "file" else README_EXAMPLE.replace("engine.shutdown()\n", "")
    script.write_text(text)
    # From a directory outside the repository, so the installed package is what gets imported.
    cmd = [sys.executable, "demo.py"] if how == "file" else [sys.executable, "-"]
    with open(script) as f:
        code, out, err = _run_script(cmd, str(tmp_path), stdin=f if how == "stdin" else None)
    assert code == 0, err[-4000:]
    answer, count = out.splitlines()[-2:]
    assert "Paris" in answer and count == "2", out
    for bad in ("Traceback", "leaked semaphore", "exited during startup"):
        assert bad not in err, err[-4000:]
