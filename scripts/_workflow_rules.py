# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Rules over parsed GitHub Actions workflows that the JSON schema cannot express (used by check_workflows.py).

Every rule takes a :class:`Workflow` (and, where it needs them, the repository root and the workspace) and returns
problems, one line each, naming the workflow, the job and what to fix. Nothing here runs a tool or touches the
network; the schema check and shellcheck live in ``check_workflows.py``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _workspace import Workspace
from packaging.specifiers import SpecifierSet

# Python minors a requires-python range is compared against (wide enough for any range this project will declare).
CANDIDATE_PYTHONS = tuple(f"3.{minor}" for minor in range(8, 16))
_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}", re.DOTALL)
_ACTION_REF = re.compile(r"^v\d+(\.\d+){0,2}$|^[0-9a-f]{40}$")
# Paths in run: scripts that must exist in the tree (a `$` or `*` in them is left to the shell).
_TREE_PATH = re.compile(r"(?<![\w./-])((?:\.ci|\.github|scripts|packages|tests|testkit|docs|benchmarks)/[\w./-]*\w)")


@dataclass
class Workflow:
    name: str  # file name, e.g. ci.yml
    data: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> Workflow:
        import yaml  # only here: release.py's other commands run with packaging alone

        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path.name}: not a mapping at the top level")
        if True in data:  # YAML 1.1 reads the key `on` as True
            data["on"] = data.pop(True)
        return cls(path.name, data)

    @property
    def jobs(self) -> dict[str, dict[str, Any]]:
        jobs = self.data.get("jobs") or {}
        return {name: job or {} for name, job in jobs.items()}

    def steps(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        for job_name, job in self.jobs.items():
            for index, step in enumerate(job.get("steps") or []):
                yield job_name, index, step

    def runs(self) -> Iterator[tuple[str, str, str]]:
        """(job, step label, script) for every ``run:`` step."""
        for job_name, index, step in self.steps():
            if "run" in step:
                label = step.get("name") or step.get("id") or f"step {index + 1}"
                yield job_name, str(label), str(step["run"])


def step_label(job: str, label: str) -> str:
    return f"job {job!r}, step {label!r}"


# --- actions --------------------------------------------------------------------------------------------------


def action_problems(wf: Workflow) -> list[str]:
    """Every ``uses:`` names a version: a release tag (``v4``, ``v1.13.0``) or a full commit SHA, never a branch."""
    problems = []
    uses: list[tuple[str, str]] = [(f"job {j!r}", str(job["uses"])) for j, job in wf.jobs.items() if "uses" in job]
    uses += [(f"job {j!r}, step {i + 1}", str(s["uses"])) for j, i, s in wf.steps() if "uses" in s]
    for where, ref in uses:
        if ref.startswith("./"):
            continue  # an action or workflow of this repository, at this commit
        if ref.startswith("docker://"):
            if "@sha256:" not in ref and not re.search(r":[\w.-]+$", ref.removeprefix("docker://")):
                problems.append(f"{wf.name}: {where}: {ref} has no tag or digest -> pin one")
            continue
        action, sep, version = ref.partition("@")
        if not sep or not version:
            problems.append(f"{wf.name}: {where}: {ref} names no version -> pin a release tag (@v4) or a commit SHA")
        elif not _ACTION_REF.match(version):
            problems.append(
                f"{wf.name}: {where}: {action}@{version} is not a release tag or a commit SHA (a branch moves under "
                "us) -> pin a release tag such as @v1.2.3 or a 40-character commit SHA"
            )
    return problems


# --- references between jobs, steps and outputs -------------------------------------------------------------------


def _needs(job: dict[str, Any]) -> list[str]:
    needs = job.get("needs") or []
    return [needs] if isinstance(needs, str) else list(needs)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _expressions(job: dict[str, Any]) -> Iterator[str]:
    """Every expression of a job: ``${{ ... }}`` anywhere, and the bare ``if:`` conditions of the job and its steps
    (GitHub evaluates those as expressions without the braces)."""
    conditions = [job.get("if")] + [step.get("if") for step in job.get("steps") or []]
    for condition in conditions:
        if isinstance(condition, str) and "${{" not in condition:
            yield condition
    for text in _strings(job):
        yield from _EXPR.findall(text)


def reference_problems(wf: Workflow) -> list[str]:
    """``needs:`` names jobs that exist; ``needs.<job>.outputs.<key>`` a job this one needs and an output it declares;
    ``steps.<id>`` a step of the same job; ``matrix.<key>`` a key of the job's matrix."""
    problems = []
    for name, job in wf.jobs.items():
        problems += [
            f"{wf.name}: job {name!r} needs {need!r}, which is not a job of this workflow"
            for need in _needs(job)
            if need not in wf.jobs
        ]
        for expr in _expressions(job):
            problems += [f"{wf.name}: job {name!r} {p}" for p in _expression_problems(expr, job, wf.jobs)]
    return problems


def _matrix_keys(job: dict[str, Any]) -> set[str] | None:
    """The keys a job's matrix defines (``include`` entries too); None without a matrix or for a computed one."""
    matrix = (job.get("strategy") or {}).get("matrix")
    if not isinstance(matrix, dict):
        return None
    keys = set(matrix) - {"include", "exclude"}
    for entry in matrix.get("include") or []:
        keys |= set(entry) if isinstance(entry, dict) else set()
    return keys


def _expression_problems(expr: str, job: dict[str, Any], jobs: dict[str, dict[str, Any]]) -> list[str]:
    needs = _needs(job)
    step_ids = {str(s["id"]) for s in job.get("steps") or [] if "id" in s}
    problems = []
    for other, key in re.findall(r"\bneeds\.([\w-]+)\.outputs\.([\w-]+)", expr):
        if other not in needs:
            problems.append(f"reads needs.{other} but does not need {other!r}")
        elif key not in ((jobs.get(other) or {}).get("outputs") or {}):
            problems.append(f"reads needs.{other}.outputs.{key}, not an output of {other!r}")
    problems += [
        f"reads needs.{other}.result but does not need {other!r}"
        for other in re.findall(r"\bneeds\.([\w-]+)\.result\b", expr)
        if other not in needs
    ]
    problems += [
        f"reads steps.{step_id}, no step of this job has that id"
        for step_id in re.findall(r"\bsteps\.([\w-]+)\.", expr)
        if step_id not in step_ids
    ]
    matrix = (job.get("strategy") or {}).get("matrix")
    keys = _matrix_keys(job)
    for key in re.findall(r"\bmatrix\.([\w-]+)", expr):
        if matrix is None:
            problems.append(f"reads matrix.{key} but has no matrix")
        elif keys is not None and key not in keys:
            problems.append(f"reads matrix.{key}, not a key of its matrix")
    return problems


# --- what run: steps call -----------------------------------------------------------------------------------------


def _commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a script, as words (expressions replaced by a placeholder, continuations joined)."""
    text = _EXPR.sub("GHA_EXPR", script.replace("\\\n", " "))
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, posix=True)
        except ValueError:
            continue  # quoting spread over several lines: shellcheck reads those
        command: list[str] = []
        for word in words:
            if word in ("|", "||", "&&", ";", "then", "do", "if", "!", "else", "fi", "done") or word.startswith(
                (">", "<", "2>")
            ):
                if command:
                    yield command
                command = []
            else:
                command.append(word.rstrip(";"))
        if command:
            yield command


def path_problems(wf: Workflow, root: Path) -> list[str]:
    """Every tree path a ``run:`` script names (``scripts/x.py``, ``.ci/run``, ``packages/<dist>``) exists."""
    problems = []
    for job, label, script in wf.runs():
        for path in _TREE_PATH.findall(_EXPR.sub("", script)):
            if "$" in path or "*" in path:
                continue
            if not (root / path).exists():
                problems.append(f"{wf.name}: {step_label(job, label)} names {path}, which does not exist in the tree")
    return problems


def script_invocations(wf: Workflow, script: str) -> Iterator[tuple[str, str, list[str]]]:
    """(job, step label, arguments) of every call of ``scripts/<script>`` in the workflow's ``run:`` steps."""
    target = f"scripts/{script}"
    for job, label, text in wf.runs():
        for words in _commands(text):
            if target in words:
                yield job, label, words[words.index(target) + 1 :]


# --- Python versions --------------------------------------------------------------------------------------------


def supported_pythons(workspace: Workspace) -> list[str]:
    """The Python minors every publishable member admits (requires-python), oldest first."""
    allowed = set(CANDIDATE_PYTHONS)
    for member in workspace.members.values():
        spec = SpecifierSet(member.requires_python or "")
        allowed &= {v for v in CANDIDATE_PYTHONS if spec.contains(f"{v}.0", prereleases=True)}
        if member.python_classifiers:
            allowed &= set(member.python_classifiers)
    return sorted(allowed, key=lambda v: tuple(int(p) for p in v.split(".")))


def _python_values(wf: Workflow) -> Iterator[tuple[str, str]]:
    """(where, version) of every literal Python version the workflow sets up or runs with."""
    env = {k: str(v) for k, v in (wf.data.get("env") or {}).items()}
    for name, job in wf.jobs.items():
        matrix = (job.get("strategy") or {}).get("matrix")
        if isinstance(matrix, dict):
            for key in ("python", "python-version"):
                for value in matrix.get(key) or []:
                    yield f"job {name!r} matrix.{key}", str(value)
    for job_name, index, step in wf.steps():
        for key in ("python-version",):
            value = str((step.get("with") or {}).get(key, ""))
            resolved = re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: env.get(m.group(1), m.group(0)), value)
            if resolved and "${{" not in resolved:
                yield f"job {job_name!r}, step {index + 1} with.{key}", resolved


def python_problems(wf: Workflow, workspace: Workspace, require_full_matrix: str | None = None) -> list[str]:
    """Every Python version a job uses is one the wheels admit; ``require_full_matrix`` names the job whose matrix
    must cover every supported Python (the unit tests)."""
    supported = supported_pythons(workspace)
    problems = [
        f"{wf.name}: {where} is Python {version}, which the wheels do not admit (requires-python: {supported})"
        for where, version in _python_values(wf)
        if version not in supported
    ]
    if require_full_matrix is not None:
        job = wf.jobs.get(require_full_matrix)
        matrix = ((job or {}).get("strategy") or {}).get("matrix") or {}
        covered = sorted(str(v) for v in (matrix.get("python") or matrix.get("python-version") or []))
        if covered != supported:
            problems.append(
                f"{wf.name}: job {require_full_matrix!r} runs Python {covered} but the wheels admit {supported} "
                "(requires-python / classifiers) -> make the matrix the supported versions"
            )
    return problems


# --- release tags -----------------------------------------------------------------------------------------------


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """GitHub's filter pattern syntax: ``*`` any characters but ``/``, ``**`` any characters, ``?`` / ``+`` / ``[]``
    as in regular expressions, everything else literal."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        char = pattern[i]
        if char == "*":
            out.append("[^/]*")
        elif char in "?+":
            out.append(char)
        elif char == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z")


def release_tag_patterns(wf: Workflow) -> list[str]:
    push = (wf.data.get("on") or {}).get("push") or {}
    return [str(p) for p in push.get("tags") or []]
