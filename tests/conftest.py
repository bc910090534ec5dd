"""Shared fixtures: the assets folder ($MTPSPEC_ASSETS, default ../shared/assets) and loaded models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mtpspec
from mtpspec.loading import assets_dir

torch.set_num_threads(1)  # tiny models: one thread is faster here, and results stay reproducible


def pytest_sessionstart(session) -> None:
    """The suite reads real weights and prompt sets (some modules at import, for their parameters): without the
    assets folder, stop before collection with one message naming it, not one collection error per module."""
    d = assets_dir()
    if not (d / "models" / "stories260K.bin").exists():
        pytest.exit(f"assets not found at {d}: set MTPSPEC_ASSETS to the shared assets folder", returncode=4)


@pytest.fixture(scope="session")
def assets() -> Path:
    d = assets_dir()
    if not (d / "models" / "stories260K.bin").exists():
        pytest.fail(f"assets not found at {d}: set MTPSPEC_ASSETS to the shared assets folder")
    return d


@pytest.fixture(scope="session")
def stories(assets) -> mtpspec.Model:
    return mtpspec.load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin")


@pytest.fixture(scope="session")
def stories_q80(assets) -> mtpspec.Model:
    return mtpspec.load(assets / "models" / "stories260K_q80.bin", tokenizer=assets / "models" / "tok512.bin")
