"""--max-model-len as vLLM reads it (32k, 32K; auto refused by name), and a stage-mode head's value
reaches its frontends, whose context checks used the deploy's value while the engine ran with the flag's."""

import pytest
from typer.testing import CliRunner

from omni.cli import app
from omni.engine_flags import context_length
from omni.errors import ConfigError
from tests.unit.test_cli import planned_frontends  # noqa: F401 (a fixture)


@pytest.mark.parametrize("value, n", [("2048", 2048), ("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("1M", 1 << 20)])
def test_vllms_forms_of_a_context_length(value, n):
    assert context_length(value) == n


@pytest.mark.parametrize("value, why", [("auto", "vLLM's auto"), ("-1", "vLLM's auto"), ("0", "at least 1"),
                                        ("1.5K", "token count"), ("lots", "token count")])
def test_what_is_not_a_context_length_is_refused_naming_the_flag(value, why):
    with pytest.raises(ConfigError, match=f"--max-model-len {value}: .*{why}"):
        context_length(value)


def test_a_stage_mode_heads_context_reaches_its_frontends(planned_frontends):
    head = ["serve", "smollm2", "--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", "0",
            "--port", "0", "--num-replicas", "0"]
    r = CliRunner().invoke(app, [*head, "--max-model-len", "4k"])
    assert r.exit_code == 0, r.output
    argvs = [c.argv for c in planned_frontends]
    assert argvs and all(a[a.index("--max-model-len") + 1] == "4000" for a in argvs)
    planned_frontends.clear()
    assert CliRunner().invoke(app, head).exit_code == 0
    assert planned_frontends and all("--max-model-len" not in c.argv for c in planned_frontends)   # the deploy's, from its config


def test_a_frontend_child_takes_the_heads_context():
    from omni.children import parser

    a = parser().parse_args(["frontend", "--config", "c", "--master", "m", "--max-model-len", "4000"])
    assert a.max_model_len == 4000
