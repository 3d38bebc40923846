"""Every file under examples/ runs as docs/recipes.md shows it, from a directory that is not the
repository's: the single-process ones with ``python examples/NAME.py``, the multi-rank ones under
``torchrun --standalone`` (its own rendezvous on a free port) on gloo, each exiting 0 and printing
its summary line (and the line that shows its point: the injected overflow skipped, the collective
count). The recipes page shows these files through mkdocs' snippets (``--8<--``), so its code
blocks are not Python that tests/test_docs.py could run; ``test_recipes_page_shows_every_example``
checks that the page and this list name the same files.

One xdist group: the launches run one after another on one worker (about 45 s on 2 cores), so that
the 4-rank HSDP run does not share the cores with another example's ranks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RECIPES = ROOT / "docs" / "recipes.md"

#: The summary line every example prints (rank 0 only under torchrun).
SUMMARY = re.compile(
    r"^skipped steps: (?P<skipped>\d+) of (?P<updates>\d+), final scale: \S+$", re.M
)

#: The lines examples/skip_account.py prints on 2 ranks (the Recipes page's "Skip account"): each
#: skip's report, the causes, the totals, the metrics.
SKIP_ACCOUNT_LINES = (
    r"^skipped: step 4 was skipped \(overflow\): step 4 \(loss scale 65536\): (nan|inf) in ",
    r"^skipped: step 7 was skipped \(replica mismatch\): step 7: gradients of rank\(s\) 0, 1 "
    r"differ from their replicas' \(replica set of ranks \[0, 1\]\)$",
    r"^causes: \{'overflow': 1, 'replica_mismatch': 1, 'not_committed': 0\}$",
    r"^skipped steps: 2 of 10 \(overflow 1, replica_mismatch 1\)$",
    r"^metrics: distscaler/skipped_replica_mismatch = 1$",
    r"^metrics: distscaler/replica_mismatches = 1$",
)

#: name -> (ranks, None for a single process; the lines the example must print beyond the
#: summary: one pattern, or several).
RUNS: dict[str, tuple[int | None, str | tuple[str, ...] | None]] = {
    "typical": (None, None),
    "clipping": (None, r"^last norm: \d"),
    "gradient_penalty": (None, None),
    "multiple_models": (2, r"^all_reduce per iteration: 2 \(2 optimizers\)$"),
    "accumulation": (2, r"^micro-batches per step: 4$"),
    "ddp": (2, r"^skipped: step 8 \(loss scale \S+\): inf in `0\.weight` on rank 1$"),
    "fsdp2": (2, None),
    "hsdp": (4, r"^mesh: \[\[0, 1\], \[2, 3\]\] \(replicate x shard\)$"),
    "skip_account": (2, SKIP_ACCOUNT_LINES),
}

#: Variables a surrounding launcher may have set; the examples' own torchrun sets its own.
LAUNCHER_ENV = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
}

TIMEOUT_S = 180


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    # This checkout's distscaler first, as an installed one would be.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # A session of its own, so that a timeout kills torchrun's ranks too.
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s:\n{stdout}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.xdist_group("examples")
@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs(name: str, tmp_path: Path) -> None:
    nproc, expected = RUNS[name]
    script = str(EXAMPLES / f"{name}.py")
    if nproc is None:
        cmd = [sys.executable, script]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, f"--nproc-per-node={nproc}", script]
    done = _run(cmd, cwd=tmp_path)  # not the repository: the examples read no relative path
    assert done.returncode == 0, (
        f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    )
    summaries = list(SUMMARY.finditer(done.stdout))
    assert len(summaries) == 1, f"one summary line expected (rank 0 only):\n{done.stdout}"
    assert int(summaries[0]["updates"]) > 0
    for pattern in (expected,) if isinstance(expected, str) else expected or ():
        assert re.search(pattern, done.stdout, re.M), f"{pattern!r} not in:\n{done.stdout}"


def test_every_example_is_run() -> None:
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


def test_recipes_page_shows_every_example() -> None:
    """docs/recipes.md includes each example file once, and only files that exist."""
    text = RECIPES.read_text(encoding="utf-8")
    shown = re.findall(r'^--8<-- "examples/(?P<name>[\w-]+)\.py"$', text, re.M)
    assert sorted(shown) == sorted(RUNS)
    # Each include sits in a fenced Python block titled with the file it shows.
    blocks = re.findall(
        r'^```python title="examples/([\w-]+)\.py"\n--8<-- "examples/\1\.py"\n```$', text, re.M
    )
    assert sorted(blocks) == sorted(RUNS)
