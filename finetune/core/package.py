"""Where the installed package's own files are (its data, and configs/ and recipes/ in a wheel)."""

from pathlib import Path

# The `finetune` package folder (a run directory inside it is refused; bundled data lives under it).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
