"""brass.catalog's download path without network: a tiny package index on 127.0.0.1 serves fake
wheels for a fake catalog entry whose pins match a small generated payload. A wheel or an
assembled file with one flipped byte must be refused with a one-line error and not left in the
cache; wheels go once their model is verified (BRASS_KEEP_WHEELS=1 keeps them); the progress bars
name the model and the part, not the carrier package; a line says when a fetch starts and ends,
terminal or not. The cache folder ($BRASS_CACHE, $XDG_CACHE_HOME), and `brass models` listing
and removing what it holds."""

import hashlib
import io
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from brass import catalog, cli
from brass.errors import BrassError, DownloadError
from brass.flags import ConfigError

PAYLOAD = bytes(range(256)) * 40 + b"tail"          # the "GGUF": 10244 bytes in three chunks
CHUNKS = (PAYLOAD[:4000], PAYLOAD[4000:8000], PAYLOAD[8000:])
NAME = "fake-model"


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _flip(b: bytes, at: int) -> bytes:
    return b[:at] + bytes([b[at] ^ 0x01]) + b[at + 1:]


def _wheel_bytes(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(zipfile.ZipInfo(member, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def _member(i: int) -> str:
    return f"brass_fake_part{i + 1}/data/part0{i + 1}.bin"


def _model(wheel_bytes: list[bytes], payload_sha: str = _sha(PAYLOAD)) -> catalog.CatalogModel:
    return catalog.CatalogModel(
        name=NAME, filename="fake-model.gguf", sha256=payload_sha, size=len(PAYLOAD), arch="llama",
        description="Fake-Model-1B-Instruct, Q8_0 (llama architecture, test only)",
        parts=tuple(catalog.Wheel(f"brass-fake-part{i + 1}", "0.0.1", _sha(w), _member(i))
                    for i, w in enumerate(wheel_bytes)))


GOOD = [_wheel_bytes(_member(i), c) for i, c in enumerate(CHUNKS)]


class Index:
    """A PEP 691 JSON simple index plus the files, served from `files` (filename -> bytes)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2:
                    stem = parts[1].replace("-", "_") + "-"
                    body = json.dumps({"files": [
                        {"filename": f, "url": f"http://127.0.0.1:{index.port}/files/{f}"}
                        for f in index.files if f.startswith(stem)]}).encode()
                elif parts[0] == "files" and len(parts) == 2 and parts[1] in index.files:
                    body = index.files[parts[1]]
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def serve(self, model: catalog.CatalogModel, wheel_bytes: list[bytes]):
        self.files = {w.filename: b for w, b in zip(model.parts, wheel_bytes)}

    def downloads(self) -> int:
        return sum(r.startswith("/files/") for r in self.requests)


@pytest.fixture
def index(monkeypatch, tmp_path):
    idx = Index()
    monkeypatch.setenv("BRASS_PYPI_INDEX", f"http://127.0.0.1:{idx.port}/simple")
    monkeypatch.setenv("BRASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BRASS_WHEELHOUSE", raising=False)
    monkeypatch.delenv("BRASS_KEEP_WHEELS", raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield idx
    idx.server.shutdown()
    idx.server.server_close()


def _use(monkeypatch, model):
    monkeypatch.setitem(catalog.CATALOG, NAME, model)


def _cache_files():
    root = catalog.cache_dir()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_good_download_assembles_verifies_and_drops_the_wheels(index, monkeypatch):
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    path = catalog.fetch(NAME, quiet=True)
    assert path.read_bytes() == PAYLOAD
    assert catalog.cached_path(NAME) == path
    assert _cache_files() == ["models/fake-model.gguf", "models/fake-model.gguf.sha256"]
    # A second fetch uses the cache and downloads nothing.
    n = index.downloads()
    assert catalog.fetch(NAME, quiet=True) == path and index.downloads() == n == 3


def test_keep_wheels_keeps_them_and_they_reassemble_offline(index, monkeypatch):
    monkeypatch.setenv("BRASS_KEEP_WHEELS", "1")
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    path = catalog.fetch(NAME, quiet=True)
    assert sorted(f for f in _cache_files() if f.startswith("wheels/")) == \
        sorted(f"wheels/{w.filename}" for w in m.parts)
    path.unlink()
    index.files = {}                                 # "offline": the index has nothing now
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert index.downloads() == 3


def test_a_wheelhouse_is_never_emptied(index, monkeypatch, tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    m = _model(GOOD)
    for w, b in zip(m.parts, GOOD):
        (house / w.filename).write_bytes(b)
    monkeypatch.setenv("BRASS_WHEELHOUSE", str(house))
    _use(monkeypatch, m)
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert index.downloads() == 0
    assert sorted(p.name for p in house.iterdir()) == sorted(w.filename for w in m.parts)


def test_progress_names_the_model_and_the_part(index, monkeypatch):
    descs = []
    real = catalog._progress

    def spy(total, desc, quiet):
        descs.append(desc)
        return real(total, desc, quiet)

    monkeypatch.setattr(catalog, "_progress", spy)
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    catalog.fetch(NAME, quiet=True)
    assert descs == ["Fake-Model-1B-Instruct part 1/3", "Fake-Model-1B-Instruct part 2/3",
                     "Fake-Model-1B-Instruct part 3/3", "assembling Fake-Model-1B-Instruct"]
    assert not any("brass_fake" in d or ".whl" in d for d in descs)


def test_real_catalog_progress_labels():
    assert catalog.CATALOG["qwen2.5-coder-0.5b"].part_label(1) == "Qwen2.5-Coder-0.5B-Instruct part 2/6"
    assert catalog.CATALOG["smollm2-135m"].part_label(0) == "SmolLM2-135M-Instruct part 1/1"
    assert catalog.CATALOG["gemma3-270m"].part_label(3) == "Gemma 3 270M base part 4/4"


@pytest.mark.parametrize("at", [0, len(GOOD[1]) // 2, len(GOOD[1]) - 1])
def test_a_wheel_with_one_flipped_byte_is_refused_and_not_kept(index, monkeypatch, at):
    m = _model(GOOD)                                 # pins are those of the good wheels
    _use(monkeypatch, m)
    bad = [GOOD[0], _flip(GOOD[1], at), GOOD[2]]
    index.serve(m, bad)
    with pytest.raises(DownloadError) as e:
        catalog.fetch(NAME, quiet=True)
    msg = _one_line(e)
    assert "Fake-Model-1B-Instruct part 2/3" in msg and m.parts[1].filename in msg
    assert "sha256" in msg and _sha(bad[1]) in msg and m.parts[1].sha256 in msg
    files = _cache_files()
    assert f"wheels/{m.parts[1].filename}" not in files
    assert not any(f.endswith(".part") for f in files)
    assert not any(f.startswith("models/") for f in files)
    assert catalog.cached_path(NAME) is None
    # Once the index serves the real thing, the same fetch works.
    index.serve(m, GOOD)
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert _cache_files() == ["models/fake-model.gguf", "models/fake-model.gguf.sha256"]


def test_an_assembled_file_with_one_flipped_byte_is_refused_and_not_kept(index, monkeypatch):
    # A substituted wheel whose own pin matches (the catalog pinned the wrong wheel, or both the
    # wheel and its pin were swapped): only the assembled file's sha256 can catch it.
    bad = [GOOD[0], GOOD[1], _wheel_bytes(_member(2), _flip(CHUNKS[2], 7))]
    m = _model(bad)
    _use(monkeypatch, m)
    index.serve(m, bad)
    with pytest.raises(DownloadError) as e:
        catalog.fetch(NAME, quiet=True)
    msg = _one_line(e)
    assert "Fake-Model-1B-Instruct" in msg and "assembled fake-model.gguf" in msg
    assert "sha256" in msg and _sha(_flip(PAYLOAD, 8007)) in msg and m.sha256 in msg
    files = _cache_files()
    assert not any(f.startswith("models/") for f in files), files
    assert catalog.cached_path(NAME) is None
    # With the right wheel pinned and served, the fetch works.
    good = _model(GOOD)
    _use(monkeypatch, good)
    index.serve(good, GOOD)
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert _cache_files() == ["models/fake-model.gguf", "models/fake-model.gguf.sha256"]


def test_a_corrupted_cached_wheel_is_not_used(index, monkeypatch):
    monkeypatch.setenv("BRASS_KEEP_WHEELS", "1")
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    path = catalog.fetch(NAME, quiet=True)
    path.unlink()
    w = catalog.cache_dir() / "wheels" / m.parts[0].filename
    w.write_bytes(_flip(w.read_bytes(), 100))
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert index.downloads() == 4                    # the bad one was fetched again
    assert w.read_bytes() == GOOD[0]


def test_an_unstamped_cached_model_with_a_flipped_byte_is_replaced(index, monkeypatch):
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    target = catalog.cache_dir() / "models" / m.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(_flip(PAYLOAD, 5000))         # put there by hand, no stamp
    assert catalog.cached_path(NAME) is None
    assert catalog.fetch(NAME, quiet=True).read_bytes() == PAYLOAD
    assert catalog.cached_path(NAME) == target


def test_a_wheel_without_the_member_is_a_clear_error(index, monkeypatch):
    bad = [GOOD[0], _wheel_bytes("something/else.bin", CHUNKS[1]), GOOD[2]]
    m = _model(bad)
    _use(monkeypatch, m)
    index.serve(m, bad)
    with pytest.raises(DownloadError, match="cannot assemble Fake-Model-1B-Instruct") as e:
        catalog.fetch(NAME, quiet=True)
    _one_line(e)
    assert not any(f.startswith("models/") for f in _cache_files())


# --------------------------------------------------------------------------------------------
# What a fetch says, terminal or not


def test_a_download_says_when_it_starts_and_ends_without_a_terminal(index, monkeypatch, capfd):
    """stderr is a pipe here (no progress bar): still one line when the download starts and
    one when the model is ready, with its name and size; a cached model says nothing."""
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    catalog.fetch(NAME, quiet=True)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == f"brass: downloading {NAME} (10 KiB) from the package index into {catalog.cache_dir()} ..."
    assert lines[1].startswith(f"brass: {NAME} ready (10 KiB in ") and lines[1].endswith(" s)"), lines
    catalog.fetch(NAME, quiet=True)
    assert capfd.readouterr().err == ""


def test_assembling_from_a_wheelhouse_says_so(index, monkeypatch, tmp_path, capfd):
    house = tmp_path / "house"
    house.mkdir()
    m = _model(GOOD)
    for w, b in zip(m.parts, GOOD):
        (house / w.filename).write_bytes(b)
    monkeypatch.setenv("BRASS_WHEELHOUSE", str(house))
    _use(monkeypatch, m)
    catalog.fetch(NAME, quiet=True)
    lines = capfd.readouterr().err.splitlines()
    assert lines[0] == f"brass: assembling {NAME} (10 KiB) from wheels already here ..." and len(lines) == 2


def test_a_failed_download_does_not_say_ready(index, monkeypatch, capfd):
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, [GOOD[0], _flip(GOOD[1], 3), GOOD[2]])
    with pytest.raises(DownloadError):
        catalog.fetch(NAME, quiet=True)
    err = capfd.readouterr().err
    assert "downloading" in err and "ready" not in err


# --------------------------------------------------------------------------------------------
# The cache folder, and the settings read when used


def test_cache_folder_follows_brass_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BRASS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert catalog.cache_dir() == tmp_path / "home" / ".cache" / "brass"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "brass"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")     # the XDG spec: ignore a relative one
    assert catalog.cache_dir() == tmp_path / "home" / ".cache" / "brass"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("BRASS_CACHE", str(tmp_path / "mine"))
    assert catalog.cache_dir() == tmp_path / "mine"


def test_settings_are_read_through_flags_when_used(index, monkeypatch):
    """BRASS_KEEP_WHEELS takes the words every BRASS_* switch takes (set after import), and a
    value that is no switch is a one-line error naming the variable."""
    monkeypatch.setenv("BRASS_KEEP_WHEELS", "yes")
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    catalog.fetch(NAME, quiet=True)
    assert any(f.startswith("wheels/") for f in _cache_files())
    catalog.remove(NAME)
    monkeypatch.setenv("BRASS_KEEP_WHEELS", "maybe")
    with pytest.raises(ConfigError, match="BRASS_KEEP_WHEELS") as e:
        catalog.fetch(NAME, quiet=True)
    _one_line(e)


# --------------------------------------------------------------------------------------------
# `brass models`: what is cached; `brass models --rm NAME`


def test_models_lists_what_is_cached_and_where(index, monkeypatch, capsys):
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert row.split()[3] == "no", row
    assert f"cache: {catalog.cache_dir()} (0 KiB of catalog models)" in out
    catalog.fetch(NAME, quiet=True)
    capsys.readouterr()
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert "10 KiB on disk" in row, row
    assert catalog.cache_usage(NAME) == len(PAYLOAD) + len(m.sha256) + 1     # the file and its stamp


def test_models_rm_removes_a_cached_model(index, monkeypatch, capsys):
    monkeypatch.setenv("BRASS_KEEP_WHEELS", "1")
    m = _model(GOOD)
    _use(monkeypatch, m)
    index.serve(m, GOOD)
    catalog.fetch(NAME, quiet=True)
    other = catalog.cache_dir() / "models" / "someone-elses.gguf"
    other.write_bytes(b"not ours")
    capsys.readouterr()
    held = catalog.cache_usage(NAME)
    assert held > 2 * len(PAYLOAD)          # the model and its three wheels
    assert cli.main(["models", "--rm", NAME]) == 0
    out = capsys.readouterr().out
    assert out == f"removed {NAME} from {catalog.cache_dir()} ({catalog.human_size(held)} freed)\n"
    # the model, its stamp and its kept wheels are gone; nothing else is touched
    assert _cache_files() == ["models/someone-elses.gguf"]
    assert catalog.cached_path(NAME) is None


@pytest.mark.parametrize("name,message", [
    (NAME, f"brass: error: {NAME} is not in the cache ("),
    ("fake-modl", "brass: error: 'fake-modl' is not a catalog model; did you mean fake-model?"),
    ("nothing-like-it", "brass: error: 'nothing-like-it' is not a catalog model ("),
])
def test_models_rm_of_a_model_not_cached_or_unknown_is_one_line(index, monkeypatch, capsys, name, message):
    _use(monkeypatch, _model(GOOD))
    assert cli.main(["models", "--rm", name]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    with pytest.raises(BrassError):
        catalog.remove(name)
