"""benchmarks/gpu_check.sh's plumbing, with `python3` and `nvidia-smi` replaced by shims that only
record their arguments: step names checked, the whole call kept to its budget, outputs under $OUT."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.e2e.harness import wait_until

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def run(tmp_path: Path, *steps: str, budget: str = "420", step_seconds: int = 0, step_also: str = ""):
    """`step_also`: more of the shim's script for each step's command."""
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    (shims / "python3").write_text(f'#!/bin/bash\ncase "$*" in *pip*|-c*) exit 0;; esac\necho "ran $*"\n'
                                   f'{step_also}\nsleep {step_seconds}\n')
    (shims / "nvidia-smi").write_text("#!/bin/bash\necho H200\n")
    for f in shims.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), GPU_CHECK_SECONDS=budget)
    return subprocess.run(["bash", str(SCRIPT), *steps], env=env, cwd=SCRIPT.parents[1], capture_output=True,
                          text=True, timeout=60)


def test_unknown_step_and_budget_refused(tmp_path):
    r = run(tmp_path, "frame", "qwen3_stage")
    assert r.returncode == 2 and "no step 'qwen3_stage'" in r.stdout and "qwen3_stages" in r.stdout
    r = run(tmp_path, budget="7m")
    assert r.returncode == 2 and "GPU_CHECK_SECONDS" in r.stdout
    assert not (tmp_path / "out").exists()


def test_steps_in_order_each_to_its_file(tmp_path):
    r = run(tmp_path, "transport", "qwen3_stages")
    assert r.returncode == 0, r.stdout + r.stderr
    order = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("== ")]
    assert order == ["qwen3_stages", "transport"]                  # the script's order, not the caller's
    stages = (tmp_path / "out" / "qwen3_stages.txt").read_text()
    assert "--real-size --device cuda --streams 1,16" in stages and "exit 0 after" in stages
    assert "killed" not in stages        # it left nothing running
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.txt", "qwen3_stages.txt", "transport.txt"]


def test_budget_cuts_the_last_steps(tmp_path):
    """A 32 s budget and steps of 2 s each: the first step runs under what is left, then under 30 s
    remain and the rest are skipped by name."""
    r = run(tmp_path, budget="32", step_seconds=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== qwen3_stages (limit 3" in r.stdout          # 32 s, or 31 if a second turned meanwhile
    skipped = [line.split()[1].rstrip(":") for line in r.stdout.splitlines() if "skipped" in line]
    assert skipped and skipped[-1] == "qwen3_wide" and "qwen3_stages" not in skipped
    ran = {p.stem for p in (tmp_path / "out").iterdir()} - {"gpu"}
    assert ran and not ran & set(skipped)


def cuda_test_files() -> set[str]:
    """The unit test files with tests marked `cuda` on a GPU: `cuda_path` or the `cuda` mark, or a
    module-level test or fixture taking conftest's device fixtures (`device`, `gpu`, `talker_path`)."""
    import ast

    found = set()
    for path in sorted((SCRIPT.parents[1] / "tests" / "unit").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        marked = any(isinstance(n, ast.Name) and n.id == "cuda_path" or isinstance(n, ast.Attribute)
                     and n.attr == "cuda" and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
                     for n in ast.walk(tree))
        if marked or any({"device", "gpu", "talker_path"} & {a.arg for a in d.args.args} for d in defs):
            found.add(f"tests/unit/{path.name}")
    return found


def test_cuda_tests_runs_every_file_with_cuda_tests(tmp_path):
    """test_qwen3_subtalker.py (subtalker sampling baked into graphs against eager), the benchmark's
    frame test and the diffusion engines' were not in the list, so their `cuda` tests never ran."""
    r = run(tmp_path, "cuda_tests")
    assert r.returncode == 0, r.stdout + r.stderr
    args = (tmp_path / "out" / "cuda_tests.txt").read_text().split()
    assert "-m" in args and args[args.index("-m") + 1] == "pytest" and args[args.index("-m", 2) + 1] == "cuda"
    listed = {a for a in args if a.startswith("tests/")}
    assert listed == cuda_test_files()
    assert {"tests/unit/test_qwen3_subtalker.py", "tests/unit/test_cuda_ipc.py"} <= listed


def test_nothing_a_step_starts_outlives_it(tmp_path):
    """A step's command that leaves a process behind (a test's child holding the GPU), one that ignores
    TERM: it is killed when the step ends, and the step's file says so. It outlived the step and shared
    the GPU with the next step's timings."""
    pids = tmp_path / "pids"
    r = run(tmp_path, "frame", step_also=f'(trap "" TERM; exec sleep 300) & echo $! >> {pids}')
    left = [int(p) for p in pids.read_text().split()]
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        # KILLed as the step ends; the kernel may take a moment to end it on a loaded box
        assert left
        wait_until(lambda: not [pid for pid in left if alive(pid)], 10, "the step's leftover to be gone")
        text = (tmp_path / "out" / "frame.txt").read_text()
        assert f"killed what frame left running: {left[0]}" in text and "exit 0 after" in text
    finally:
        for pid in left:
            if alive(pid):
                os.kill(pid, 9)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
