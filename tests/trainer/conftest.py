"""Makes `eopd_trainer` importable from a plain checkout (bootstrap installs it editable anyway)."""

import sys
from pathlib import Path

try:  # pragma: no cover - depends on how the package was installed
    import eopd_trainer  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services" / "trainer"))
