"""Shared test fixtures. `measured` records the figures a test compares (max differences and
tolerances) and prints them as one table at the end of the run, for closing notes and CI logs."""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A subprocess that dies of a signal (an abort in native code) prints every thread's Python stack.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# One persistent compilation cache for the session, shared with the trainer subprocesses: the same
# small models are compiled again and again (a 2-layer model's random init alone takes ~8 s to
# compile on 2 cores, ~0.5 s from the cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="diffjax-test-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# 8 simulated CPU devices for the sharding tests (XLA reads this when jax starts; tests that want one
# device use a mesh of one, e.g. parallel.data=1).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The tests compile hundreds of small programs and run each on tiny shapes: LLVM's optimizations cost more compile
# time than they save (measured: the attention-kinds walk + context tests 144 -> 100 s). HLO passes are unchanged.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# The GCS emulator (the `gcs` fixture) has no storage-layout API: gcsfs's default filesystem asks it on every call and
# logs a warning each time. Its plain filesystem, set before anything imports gcsfs (trainer subprocesses inherit it).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest

_FIGURES: list[tuple[str, str, float, float]] = []


@pytest.fixture
def measured(request):
    """record(what, value, tolerance) -> value. Figures travel in the test report's user_properties, so the
    table is complete when pytest-xdist runs the tests in worker processes."""

    def record(what: str, value: float, tolerance: float = float("nan")) -> float:
        request.node.user_properties.append(("measured", (what, float(value), float(tolerance))))
        return float(value)

    return record


def pytest_runtest_logreport(report):
    if report.when == "call":
        name = report.nodeid.split("::")[-1]
        _FIGURES.extend((name, *figure) for key, figure in report.user_properties if key == "measured")


# The files that take longest, longest first (CPU seconds of the whole suite, 2026-11-27). `--dist loadfile` hands
# out whole files in collection order (with pyproject's --no-loadscope-reorder: since xdist 3.5 it otherwise sorts
# files by their number of tests, and this order was lost); started last, one of these kept one worker busy for
# minutes after the other had finished. Every other file keeps its place after them.
LONGEST_FILES = ("test_readme_recipes.py", "test_motif3.py", "test_motif3_lora.py", "test_expert_parallel.py",
                 "test_ops_pallas_gpu.py", "test_capture.py", "test_attention_kinds.py", "test_trainer.py",
                 "test_context_parallel.py", "test_robustness.py", "test_kernel_resources.py")
# The files that compile for absent hardware in the test process itself (libtpu's and the CUDA plugin's compilers
# loaded beside XLA:CPU's), last: a worker that ran them runs little else after. A worker died once of a segfault in
# XLA:CPU's executable serialization after such files had run in it (CI, 2026-11-29; never reproduced alone).
LAST_FILES = ("test_aot.py", "test_aot_plan.py", "test_aot_kernels.py")


@pytest.fixture(autouse=True, scope="module")
def _memory_released_after_each_file():
    """A worker gives back what a file's compiled programs held: jax's caches keep every executable a test compiled
    for the worker's life, and glibc keeps freed memory in its arenas. Without this a worker grew to 7-9 GiB over the
    oldest leg (18 GiB used of CI's 24 at its peak, beside trainer subprocesses); a worker died there, killed with no
    stack (CI, 2026-11-29). Measured on 4 files in one process: 4.5 GiB at the end before, 1.0 GiB after; same time."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test starts from the session's environment: a command's main() called in-process may set variables for
    the rest of its process (diffjax-eval switches the Hub's offline mode on when the Hub does not answer), which
    would leak into the worker's later tests."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES), LAST_FILES last (a stable sort, the same in every xdist worker);
    `gpu` tests run only where JAX's default backend is a GPU (JAX_PLATFORMS=cuda pytest -m gpu)."""
    import jax

    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    rank.update({name: len(rank) + 1 + i for i, name in enumerate(LAST_FILES)})
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAX_PLATFORMS=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("measured differences against the references")
    width = max(len(name) for name, *_ in _FIGURES)
    for name, what, value, tolerance in _FIGURES:
        terminalreporter.write_line(f"{name:<{width}}  {what:<40} {value:10.3e}" + (f"  (tolerance {tolerance:.1e})" if tolerance == tolerance else ""))


@pytest.fixture(scope="session")
def gcs():
    """A Google Cloud Storage emulator on localhost (gcp-storage-emulator, in memory, one per test process: gcsfs
    and tensorstore keep their endpoint for the process's life), with the environment that points gcsfs,
    google-cloud-storage and tensorstore at it set here and returned for subprocesses. Yields GcsEmulator."""
    pytest.importorskip("gcp_storage_emulator")
    pytest.importorskip("gcsfs")
    from gcs_emulator import GcsEmulator

    with GcsEmulator() as emulator:
        yield emulator
