"""The test suite; its rooms mirror the code's (tests/store/, tests/projection/, ...)."""

from pathlib import Path

#: The checkout's root, wherever a test module sits below it.
REPO = Path(__file__).resolve().parent.parent
