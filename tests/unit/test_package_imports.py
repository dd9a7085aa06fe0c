"""What `import accelerate_zero` loads: the engine, not the integrations' libraries (loaded on first use)."""

import subprocess
import sys


_PROBE = """
import sys
import accelerate_zero
print(sorted(name for name in ("accelerate", "transformers", "deepspeed") if name in sys.modules))
print(accelerate_zero.ZeroAccelerator.__module__, "accelerate" in sys.modules)
print(sorted(name for name in accelerate_zero.__all__ if not hasattr(accelerate_zero, name)))
"""


def test_import_loads_the_engine_only_and_integrations_on_first_use():
    # A fresh interpreter: the test session has long imported accelerate and transformers.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=180)
    loaded, accelerator, missing = done.stdout.splitlines()
    assert loaded == "[]", f"`import accelerate_zero` imported {loaded}; the engine needs none of them"
    assert accelerator == "accelerate_zero.integrations.accelerate.accelerator True"
    assert missing == "[]", f"names in accelerate_zero.__all__ that cannot be reached: {missing}"
