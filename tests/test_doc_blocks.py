"""Every fenced block a reader is told to run, on README.md, CONTRIBUTING.md and the pages of
docs/ (those of tests/test_docs.py), is run by a test, or marked on its page with why it is not.

How a block is run, by its kind and the HTML comment right above its fence (MkDocs and GitHub do
not render comments):

* ```` ```python ````: tests/test_docs.py runs it (Sybil), unless ``<!-- skip: next "REASON" -->``
  is above it; a titled one shows a file of the repository (``--8<-- "examples/NAME.py"``, which
  tests/test_examples.py runs; a part of a launch/ script, which its test launches).
* a shell block (```` ```bash ````, ``sh``, ``shell``, ``console``): ``<!-- not run: REASON -->``
  above it, or it is run: here (``RUN_HERE``: the quick ones in the default suite, the launches
  under ``slow``), or by the test or CI stage that ``COVERED`` names, whose file must contain the
  command's script (checked here, so that an entry cannot outlive the test it names).
* ``<!-- file: NAME -->`` above a Python block: the reader saves it as NAME; the page's commands
  run beside it. ``<!-- output of: COMMAND -->`` above a text block: what COMMAND prints on its
  standard output, compared line by line.

The core pages' Python blocks also run in a fresh venv holding the library alone (its wheel and
torch, no extra): ``test_core_pages_run_with_the_library_alone``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from _plain_env import link_torch

ROOT = Path(__file__).resolve().parent.parent

#: The pages tests/test_docs.py reads: docs/benchmarks/ holds reports that launch/bench.py writes.
PAGES = sorted(
    [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.exists()]
    + [
        p
        for p in (ROOT / "docs").rglob("*.md")
        if "benchmarks" not in p.relative_to(ROOT).parts[1:-1]
    ]
)

SHELL = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
    re.MULTILINE | re.DOTALL,
)
_MARKERS = {
    "skip": re.compile(r'^<!-- skip: next "(?P<value>[^"]+)" -->$'),
    "not run": re.compile(r"^<!-- not run: (?P<value>.+) -->$"),
    "file": re.compile(r"^<!-- file: (?P<value>[\w.-]+) -->$"),
    "output of": re.compile(r"^<!-- output of: (?P<value>.+) -->$"),
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    info: str  # what follows the language on the fence line (a title)
    body: str  # dedented
    marker: tuple[str, str] | None  # (kind, value) of the comment right above the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.body.strip().splitlines()[0].strip()


def _marker(text: str, start: int) -> tuple[str, str] | None:
    before = text[:start].rstrip("\n").splitlines()
    above = before[-1].strip() if before else ""
    for kind, pattern in _MARKERS.items():
        match = pattern.match(above)
        if match:
            return kind, match["value"]
    return None


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            body = textwrap.dedent(m["body"])
            found.append(
                Block(
                    page=page.relative_to(ROOT).as_posix(),
                    line=text.count("\n", 0, m.start()) + 1,
                    lang=m["lang"],
                    info=m["info"].strip(),
                    body=body,
                    marker=_marker(text, m.start()),
                )
            )
    return found


BLOCKS = blocks()

#: Shell blocks this module runs, by (page, first line): the test that runs each.
RUN_HERE: dict[tuple[str, str], str] = {
    (
        "docs/install.md",
        'python -c "import distscaler; print(distscaler.__version__)"    # 0.1.0',
    ): "test_the_version_command_prints_what_the_page_says",
    (
        "docs/troubleshooting.md",
        "grep -o -w -E 'amx_fp16|avx512_fp16' /proc/cpuinfo | sort -u",
    ): "test_the_fp16_units_command_runs",
    (
        "docs/troubleshooting.md",
        "torchrun --standalone --nproc-per-node=2 probe.py",
    ): "test_the_replica_probe_finds_the_rank_local_write_on_2_gloo_ranks",
    (
        "docs/integrations/lightning.md",
        "python launch/train_lightning.py --devices 2 --strategy ddp --inject-inf 5     "
        "# or --strategy fsdp2",
    ): "test_the_lightning_job_runs_as_the_page_shows",
    ("docs/install.md", "pip install .          # a regular install"): (
        "test_core_pages_run_with_the_library_alone (the wheel of `pip install .`, no extra)"
    ),
}

_README_JOB = (
    'pip install -e ".[train]" && torchrun --standalone --nproc-per-node=2 launch/train.py'
)
_README_TESTS = 'pip install -e ".[test]" && pytest -n auto'

#: Shell blocks another test or a CI stage runs, by (page, first line): (the file that runs it,
#: what that file must contain). A launch's test runs its script on 2 gloo ranks with small
#: settings; a CI stage (.ci/run) runs the install or the command as the page writes it.
COVERED: dict[tuple[str, str], tuple[str, str]] = {
    ("README.md", _README_JOB): ("tests/test_train.py", "def test_the_default_command_shows"),
    ("docs/getting-started.md", _README_JOB): (
        "tests/test_train.py",
        "def test_the_default_command_shows",
    ),
    ("docs/reference-job.md", _README_JOB): (
        "tests/test_train.py",
        "def test_the_default_command_shows",
    ),
    ("README.md", _README_TESTS): (".ci/run", "pytest -n auto"),
    ("docs/getting-started.md", _README_TESTS): (".ci/run", "pytest -n auto"),
    ("docs/reference-job.md", _README_TESTS): (".ci/run", "pytest -n auto"),
    ("docs/testing.md", _README_TESTS): (".ci/run", "pytest -n auto"),
    (
        "docs/testing.md",
        'pytest -n auto -m "slow or integration"     # what the default leaves out; CI runs both',
    ): (".ci/run", "slow or integration"),
    ("docs/install.md", "pip install build twine"): (".ci/run", "twine check --strict"),
    ("docs/install.md", 'pip install ".[megatron]"'): (
        ".ci/run",
        "--ignore-requires-python --no-deps",
    ),
    ("docs/integrations/slime.md", 'pip install "distscaler[slime]"'): (
        ".ci/run",
        "--ignore-requires-python --no-deps",
    ),
    ("docs/install.md", "python -m venv .venv-verl && source .venv-verl/bin/activate"): (
        ".ci/run",
        ".venv-verl",
    ),
    (
        "docs/integrations/verl.md",
        "python -m venv .venv-verl && source .venv-verl/bin/activate",
    ): (".ci/run", ".venv-verl"),
    ("docs/integrations/verl.md", 'pip install ".[verl]" einops'): (".ci/run", ".venv-verl"),
    ("docs/integrations/areal.md", "pip install torch==2.10.0"): (".ci/run", "areal==1.0.4"),
    (
        "docs/integrations/accelerate.md",
        "accelerate launch --config_file configs/accelerate/multi_cpu.yaml "
        "launch/train_accelerate.py \\",
    ): ("tests/test_accelerate.py", "train_accelerate.py"),
    (
        "docs/integrations/areal.md",
        "torchrun --nproc-per-node 2 launch/train_areal.py --inject-inf 3            # ours",
    ): ("tests/test_areal.py", "train_areal"),
    (
        "docs/integrations/megatron.md",
        "torchrun --nproc-per-node 2 launch/train_megatron.py --steps 8 --inject-inf 3",
    ): ("tests/test_megatron.py", "train_megatron"),
    (
        "docs/integrations/megatron.md",
        "torchrun --nproc-per-node 2 launch/train_megatron.py --steps 8 --inject-inf 3"
        "            # ours",
    ): ("tests/test_megatron.py", "train_megatron"),
    (
        "docs/integrations/nemo_rl.md",
        "torchrun --nproc-per-node 2 launch/train_nemo_rl.py --inject-inf 3            # ours",
    ): ("tests/test_nemo_rl.py", "train_nemo_rl"),
    (
        "docs/integrations/torchtitan.md",
        "torchrun --nproc-per-node 2 launch/train_torchtitan.py --inject-inf 5 "
        "--training.steps 20 --debug.seed 0",
    ): ("tests/test_torchtitan.py", "train_torchtitan"),
    (
        "docs/integrations/transformers.md",
        "torchrun --nproc-per-node 2 launch/train_transformers.py --inject-inf 5",
    ): ("tests/test_transformers.py", "train_transformers"),
    (
        "docs/integrations/verl.md",
        "torchrun --nproc-per-node 2 launch/train_verl.py --inject-inf 3                  # ours",
    ): ("tests/test_verl.py", "train_verl"),
    (
        "docs/layouts.md",
        "torchrun --standalone --nproc-per-node=2 launch/layout_costs.py "
        "--parallelism ddp fsdp1 fsdp2 tp pp",
    ): ("tests/test_layout_costs.py", "layout_costs.py"),
    (
        "docs/reference-job.md",
        "torchrun --standalone --nproc-per-node=2 --max-restarts=3 launch/train.py --resume auto",
    ): ("tests/test_train.py", "--max-restarts"),
    (
        "docs/reliability.md",
        "torchrun --standalone --nproc-per-node=2 --max-restarts=3 launch/train.py --resume auto",
    ): ("tests/test_train.py", "--max-restarts"),
    (
        "docs/reference-job.md",
        "torchrun --standalone --nproc-per-node=2 launch/train.py --parallelism fsdp1  "
        "# FSDP1 FULL_SHARD, use_orig_params",
    ): ("tests/test_train_parallelism.py", "--parallelism"),
    (
        "docs/silent-data-corruption.md",
        "torchrun --standalone --nproc-per-node=2 launch/train.py --steps 12 --inject-bitflip 5:1",
    ): ("tests/test_train.py", "inject-bitflip"),
    (
        "docs/troubleshooting.md",
        "python launch/plot_metrics.py runs/default    # writes runs/default/metrics.png",
    ): ("tests/test_train.py", "plot_metrics.py"),
}


def _shell_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang in SHELL]


def _unaccounted() -> list[str]:
    problems = []
    for b in BLOCKS:
        kind = b.marker[0] if b.marker else None
        if b.lang == "python":
            if kind == "not run":
                problems.append(f"{b.id}: a Python block takes Sybil's skip marker")
            elif b.info and not b.body.startswith('--8<-- "'):
                problems.append(f"{b.id}: a titled Python block that shows no file")
        elif b.lang in SHELL and kind != "not run":
            key = (b.page, b.first_line)
            if key not in RUN_HERE and key not in COVERED:
                problems.append(f"{b.id}: `{b.first_line}` is neither run nor marked not run")
    return problems


def test_every_block_to_run_is_run_or_marked() -> None:
    assert len(_shell_blocks()) >= 50, "the shell blocks were not found"
    assert _unaccounted() == []


def test_every_entry_names_a_block_and_a_file_that_runs_it() -> None:
    shown = {(b.page, b.first_line) for b in _shell_blocks() if b.marker is None}
    stale = sorted({*RUN_HERE, *COVERED} - shown)
    assert stale == [], f"entries for blocks that are not on their page (or are marked): {stale}"
    here = Path(__file__).read_text(encoding="utf-8")
    for key, test in RUN_HERE.items():
        assert f"def {test.split()[0]}(" in here, key
    for key, (path, needle) in COVERED.items():
        target = ROOT / path
        assert target.is_file() and needle in target.read_text(encoding="utf-8"), (key, path)


_NOT_RUN = [b for b in _shell_blocks() if b.marker and b.marker[0] == "not run"]


@pytest.mark.parametrize("block", _NOT_RUN, ids=[b.id for b in _NOT_RUN])
def test_doc_block_not_run(block: Block) -> None:
    pytest.skip(f"{block.id}: {block.marker[1]}")


# ------------------------------------------------------------------------- the blocks run here


def _block(page: str, first_line: str) -> Block:
    (found,) = [b for b in BLOCKS if b.page == page and b.first_line == first_line]
    return found


def _env(**extra: str) -> dict[str, str]:
    launcher = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_WORLD_SIZE",
    }
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``command`` in bash, as a reader types it: ``python`` and ``torchrun`` are this
    interpreter's (a session of its own, so that a timeout ends torchrun's ranks too)."""
    prelude = (
        f'python() {{ "{sys.executable}" "$@"; }}\n'
        f'torchrun() {{ "{sys.executable}" -m torch.distributed.run "$@"; }}\n'
    )
    with subprocess.Popen(
        ["bash", "-c", prelude + command],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{command} ran past {timeout} s:\n{out}\n{err[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_the_version_command_prints_what_the_page_says(tmp_path: Path) -> None:
    block = _block(
        "docs/install.md", 'python -c "import distscaler; print(distscaler.__version__)"    # 0.1.0'
    )
    command, expected = block.first_line.split("#", 1)
    done = _shell(command, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.strip()


def test_the_fp16_units_command_runs(tmp_path: Path) -> None:
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    block = _block(
        "docs/troubleshooting.md", "grep -o -w -E 'amx_fp16|avx512_fp16' /proc/cpuinfo | sort -u"
    )
    done = _shell(block.body, tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) <= {"amx_fp16", "avx512_fp16"}


def _page_files(page: str, into: Path) -> None:
    for b in BLOCKS:
        if b.page == page and b.marker and b.marker[0] == "file":
            (into / b.marker[1]).write_text(b.body, encoding="utf-8")


def _shown_output(page: str, command: str) -> list[str]:
    (shown,) = [b for b in BLOCKS if b.page == page and b.marker == ("output of", command)]
    return shown.body.strip().splitlines()


@pytest.mark.slow
def test_the_replica_probe_finds_the_rank_local_write_on_2_gloo_ranks(tmp_path: Path) -> None:
    page = "docs/troubleshooting.md"
    command = _block(page, "torchrun --standalone --nproc-per-node=2 probe.py").body.strip()
    _page_files(page, tmp_path)
    done = _shell(command, tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.strip().splitlines() == _shown_output(page, command)
    # The scaler skipped those steps, as the page says, and logged it without any logging set up.
    assert done.stderr.count("replica mismatch at step") == 3, done.stderr[-4000:]

    # What replica_check=False hides: no skip, and the parameters drift apart.
    probe = (tmp_path / "probe.py").read_text(encoding="utf-8")
    built = 'scaler = GradScaler("cpu", replica_check_interval=1).register_model(model)'
    assert built in probe
    probe = probe.replace(built, built.replace("replica_check_interval=1", "replica_check=False"))
    teardown = probe[probe.index("# Free what holds the process group"):]
    assert teardown.endswith("dist.destroy_process_group()\n")
    probe = probe[: -len(teardown)] + (
        "drifted = differ_across_ranks(dict(model.named_parameters()))\n"
        "if rank == 0:\n"
        "    print(f'skipped {scaler.skip_totals.num_skipped}, drifted {drifted}')\n" + teardown
    )
    (tmp_path / "probe.py").write_text(probe, encoding="utf-8")
    done = _shell(command, tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.strip().splitlines()[-1] == "skipped 0, drifted ['module.2.bias']"
    assert "replica mismatch" not in done.stderr


@pytest.mark.slow
def test_the_lightning_job_runs_as_the_page_shows(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="the lightning extra")
    block = _block(
        "docs/integrations/lightning.md",
        "python launch/train_lightning.py --devices 2 --strategy ddp --inject-inf 5     "
        "# or --strategy fsdp2",
    )
    # From a folder of its own holding the tree's launch/ (Lightning writes its logs there).
    (tmp_path / "launch").symlink_to(ROOT / "launch")
    done = _shell(block.body, tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    # the two ranks print to one stdout, and a line of one can run into the other's: no anchors
    summaries = re.findall(r"rank (\d): 1 of 8 steps skipped, params ([0-9a-f]{16})", done.stdout)
    assert sorted(r for r, _ in summaries) == ["0", "1"], done.stdout
    assert len({p for _, p in summaries}) == 1  # the same parameters on both ranks


# ---------------------------------------------------------------- logging, as Concepts says it


_LOG_SCRIPT = """
import logging, sys
import torch
from distscaler import GradScaler

{setup}
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = GradScaler("cpu", skip_log_interval=1).register_model(model)
scaler.scale(model(torch.ones(1, 4)).sum()).backward()
model.weight.grad[0, 0] = float("inf")
scaler.step(optimizer)
scaler.update()
"""


def _log_lines(setup: str, tmp_path: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _LOG_SCRIPT.format(setup=setup)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    return [ln for ln in done.stderr.splitlines() if "step 1" in ln or "skipped" in ln]


def test_the_log_lines_as_concepts_says_for_each_logging_setup(tmp_path: Path) -> None:
    """docs/concepts.md#what-the-scaler-logs: with no logging configuration Python's last-resort
    handler writes the WARNING lines, bare, and drops the INFO lines; basicConfig shows both at
    level INFO; the level of the "distscaler" logger silences them."""
    warning = "inf/NaN gradients at step 1 (loss scale 65536): inf in `weight` on rank 0"
    assert _log_lines("", tmp_path) == [warning]
    assert _log_lines("logging.basicConfig()", tmp_path) == [f"WARNING:distscaler:{warning}"]
    shown = _log_lines(
        'logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")',
        tmp_path,
    )
    assert shown[-1] == f"WARNING distscaler: {warning}"
    assert len(shown) == 2 and shown[0].startswith("INFO distscaler: 1 optimizer step(s) skipped")
    assert _log_lines('logging.getLogger("distscaler").setLevel(logging.ERROR)', tmp_path) == []


# ------------------------------------------------- the core pages with the library alone

#: Pages whose examples need nothing but distscaler and torch (no extra): their Python blocks,
#: with their hidden setup and without the skipped ones, run in order as one script. (The Python
#: blocks of docs/layouts.md and docs/compile.md are all skipped: partial snippets, GPUs.)
CORE_PAGES = [
    "README.md",
    "docs/getting-started.md",
    "docs/concepts.md",
    "docs/troubleshooting.md",
    "docs/migrating.md",
    "docs/reliability.md",
]

_INVISIBLE = re.compile(r"^<!-- invisible-code-block: python\n(?P<body>.*?)^-->", re.M | re.S)


def _page_script(page: str) -> str:
    """The page's Python, as tests/test_docs.py runs it: its blocks and hidden setup in order,
    a block under a skip marker left out."""
    text = (ROOT / page).read_text(encoding="utf-8")
    parts = [(m.start(), m["body"]) for m in _INVISIBLE.finditer(text)]
    for b in BLOCKS:
        if b.page == page and b.lang == "python" and not b.info:
            if b.marker and b.marker[0] == "skip":
                continue
            start = len("\n".join(text.split("\n")[: b.line - 1]))
            parts.append((start, b.body))
    return "\n".join(body for _, body in sorted(parts))


_PRINTED = re.compile(r"^\s*print\(.*\)\s+# (?P<shown>.+)$", re.M)

#: Comments after a print() that describe its output rather than show it.
DESCRIBED = {
    "invalid GradScaler state_dict: the bad scale and every missing key, one per line",
}


def _shown_prints(page: str) -> list[str]:
    """What the page's examples show their print() calls print: the comment after each, up to a
    gloss (two spaces, then an aside) or a closing " ..." (the line goes on)."""
    shown = []
    for b in BLOCKS:
        if b.page == page and b.lang == "python" and not b.info and not b.marker:
            for m in _PRINTED.finditer(b.body):
                if m["shown"] not in DESCRIBED:
                    shown.append(m["shown"].split("  ")[0].removesuffix(" ..."))
    return shown


@pytest.mark.slow
def test_core_pages_run_with_the_library_alone(tmp_path: Path) -> None:
    """docs/install.md's `pip install .`: the wheel of this tree installed into a fresh venv with
    torch (linked: no network) and nothing else, then each core page's examples there, from a
    folder of their own. launch/ is on the path for the hidden setup's gloo teardown only."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    link_torch(site)
    source = tmp_path / "source"
    shutil.copytree(ROOT / "distscaler", source / "distscaler")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("distscaler-*.whl")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    check = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stdout  # torch>=2.6 satisfied by the linked torch
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT / "launch")
    failed = {}
    for page in CORE_PAGES:
        work = tmp_path / page.replace("/", "_")
        work.mkdir()
        script = _page_script(page)
        assert "import torch" in script, f"{page}: no example found"
        (work / "page.py").write_text(script, encoding="utf-8")
        done = subprocess.run(
            [str(python), "page.py"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            failed[page] = done.stderr[-2000:]
        for shown in _shown_prints(page):  # the output the page shows, where it shows one
            if shown not in done.stdout:
                failed[page] = f"{shown!r} not printed:\n{done.stdout[-2000:]}"
    assert failed == {}
