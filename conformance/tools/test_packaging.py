"""The distribution installs one import name, brass: the repository's engine/ and kernels/
folders are mapped into it, and no top-level `engine` or `kernels` package is installed. So
Brass can live beside Hugging Face's `kernels` package (also a top-level `kernels` on PyPI).

The wheel is built from this tree and installed, with a dummy `kernels` package beside it,
into a fresh virtual environment without this machine's packages (brass imports lazily, so
`import brass` needs none of its dependencies)."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd, cwd=None):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # Build isolation fetches the build backend (setuptools) from the package index.
    r = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT)
    if r.returncode != 0:
        if "Could not find a version" in r.stderr or "NewConnectionError" in r.stderr:
            pytest.skip("no package index reachable to fetch setuptools for the wheel build")
        pytest.fail(f"pip wheel failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    (whl,) = out.glob("brass-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel):
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"brass"}, tops
    # the CUDA sources ship as package data of brass.kernels
    assert "brass/kernels/matvec_q.cu" in names and "brass/kernels/params.cuh" in names


def test_brass_installs_beside_a_kernels_package(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    dummy = tmp_path / "dummy"
    (dummy / "kernels").mkdir(parents=True)
    (dummy / "kernels" / "__init__.py").write_text('WHO = "the other kernels package"\n')
    (dummy / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "kernels"\nversion = "0.0.1"\n')
    # a one-file PEP 517 backend, so that installing the dummy needs no index
    (dummy / "backend.py").write_text(_TINY_BACKEND)
    for target in (wheel, dummy):
        r = _run(py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation", target)
        assert r.returncode == 0, r.stdout + r.stderr
    r = _run(py, "-c", (
        "import brass, brass.kernels, kernels; from importlib.resources import files; "
        "assert kernels.WHO == 'the other kernels package', kernels.__file__; "
        "assert files('brass.kernels').joinpath('mmq.cu').is_file(); "
        "print(brass.__version__)"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == _version()
    r = _run(py, "-m", "pip", "show", "-f", "brass")
    files = [line.strip() for line in r.stdout.splitlines()[r.stdout.splitlines().index("Files:") + 1:]]
    assert not [f for f in files if f.startswith(("engine/", "kernels/"))], files


def _version() -> str:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


_TINY_BACKEND = '''
import base64, hashlib, os, zipfile

NAME, VERSION = "kernels", "0.0.1"


def _record(files):
    lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    return "\\n".join(lines + [f"{NAME}-{VERSION}.dist-info/RECORD,,"]) + "\\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        "kernels/__init__.py": open("kernels/__init__.py", "rb").read(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: tiny\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{info}/RECORD", _record(files))
    return name
'''
