"""The README's vLLM-compatibility notes state where `omni serve` listens by default beside `vllm serve`'s, and
the stated default is the one the CLI has."""

from __future__ import annotations

import typer

from tests.e2e.harness import REPO


def test_readme_states_the_listen_defaults_beside_vllms():
    from omni.cli import app

    params = {p.name: p.default for p in typer.main.get_command(app).commands["serve"].params}
    text = " ".join((REPO / "README.md").read_text().split())
    assert f"`omni serve` to {params['host']}:{params['port']}" in text
    assert "`vllm serve` defaults to 0.0.0.0:8000" in text
