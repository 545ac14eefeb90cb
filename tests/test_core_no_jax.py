"""jaxserve/core/ (requests, block pool, KV cache manager, scheduler) is pure Python: each module,
imported alone in a fresh interpreter, must not pull in JAX (so it runs and is tested on plain ints)."""

import pkgutil
import subprocess
import sys

import pytest

import jaxserve.core

CORE_MODULES = sorted(f"jaxserve.core.{m.name}" for m in pkgutil.iter_modules(jaxserve.core.__path__))


def test_core_has_the_scheduler_side():
    assert {"jaxserve.core.scheduler", "jaxserve.core.kv_cache_manager", "jaxserve.core.block_pool",
            "jaxserve.core.request", "jaxserve.core.sampling_params"} <= set(CORE_MODULES)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_jax(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')));"
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{module} imports JAX: {r.stdout.strip()} {r.stderr[-2000:]}"
