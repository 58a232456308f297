"""Test-wide settings: never reach for the hub (tests use files they make or the repo ships)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
