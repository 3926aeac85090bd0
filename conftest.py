"""Isolation for every test of the repository (the core's and each plugin's), set up before any fixture
of a wider scope runs: one token and conversion cache for the session (tokenising a corpus or
converting a GGUF file is paid once, never in the user's own cache), offline W&B."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "lmlab-cache"))
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        yield
