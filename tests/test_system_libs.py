# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""scripts/system_libs.py: the README test command's first step installs the Mooncake engine's Debian libraries where
it can and names the apt line where it cannot; the tests that load Mooncake fail with that line. The "missing" paths
run with a fake loader, fake privileges and a fake apt-get (this machine has the libraries)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from npu_testkit import system_libs as kit

from tests._script_loader import SCRIPTS, load_script

ROOT = SCRIPTS.parent
libs = load_script("system_libs")


class Apt:
    """Records commands; ``installs`` is the set of packages that makes their sonames load afterwards."""

    def __init__(self, absent: set[str], sudo_ok: bool = False, fail: bool = False) -> None:
        self.absent, self.sudo_ok, self.fail = set(absent), sudo_ok, fail
        self.calls: list[list[str]] = []

    def probe(self, soname: str) -> bool:
        return soname not in self.absent

    def run(self, cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        if cmd == ["sudo", "-n", "true"]:
            return subprocess.CompletedProcess(cmd, 0 if self.sudo_ok else 1)
        if "install" in cmd and not self.fail:
            self.absent -= {s for s, pkg in libs.LIBRARIES.items() if pkg in cmd}
        return subprocess.CompletedProcess(cmd, 1 if self.fail else 0)


def which_all(name: str) -> str:
    return f"/usr/bin/{name}"


def test_present_installs_nothing(capsys) -> None:
    apt = Apt(set())
    assert libs.main([], probe=apt.probe, euid=1000, which=which_all, run=apt.run) == 0
    assert apt.calls == []
    assert "all present" in capsys.readouterr().out


def test_root_installs_only_the_missing_packages() -> None:
    apt = Apt({"libibverbs.so.1", "libnuma.so.1"})
    assert libs.main([], probe=apt.probe, euid=0, which=which_all, run=apt.run) == 0
    assert apt.calls == [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "libibverbs1", "libnuma1"],
    ]
    assert apt.absent == set()


def test_passwordless_sudo_installs_through_sudo() -> None:
    apt = Apt({"libcurl.so.4"}, sudo_ok=True)
    assert libs.main([], probe=apt.probe, euid=1000, which=which_all, run=apt.run) == 0
    assert apt.calls[-1][:4] == ["sudo", "-n", "env", "DEBIAN_FRONTEND=noninteractive"]
    assert apt.calls[-1][-1] == "libcurl4"


def test_without_root_names_the_apt_line_and_lets_pytest_run(capsys) -> None:
    apt = Apt({"libibverbs.so.1"})
    assert libs.main([], probe=apt.probe, euid=1000, which=which_all, run=apt.run) == 0
    assert apt.calls == [["sudo", "-n", "true"]]  # asked, never installed
    err = capsys.readouterr().err
    assert "not root and no passwordless sudo" in err
    assert "apt-get update && apt-get install -y --no-install-recommends libibverbs1" in err
    assert "Traceback" not in err


def test_without_apt_get_says_so(capsys) -> None:
    apt = Apt({"libnuma.so.1"})
    which = lambda name: None if name == "apt-get" else which_all(name)  # noqa: E731
    assert libs.main([], probe=apt.probe, euid=0, which=which, run=apt.run) == 0
    assert apt.calls == []
    assert "no apt-get on this machine" in capsys.readouterr().err


def test_check_exits_1_and_a_failed_install_is_an_error(capsys) -> None:
    apt = Apt({"librdmacm.so.1"})
    assert libs.main(["--check"], probe=apt.probe, euid=0, which=which_all, run=apt.run) == 1
    assert apt.calls == []
    failing = Apt({"librdmacm.so.1"}, fail=True)
    assert libs.main([], probe=failing.probe, euid=0, which=which_all, run=failing.run) == 1
    assert "librdmacm1" in capsys.readouterr().err


def test_the_tests_fail_with_the_scripts_line(monkeypatch) -> None:
    """Never a skip, never a loader traceback: the test that needs Mooncake fails with the apt line."""
    monkeypatch.setattr(kit.system_libs(), "missing", lambda probe=None: ["libnuma.so.1"])
    with pytest.raises(pytest.fail.Exception) as failed:
        kit.require_mooncake_libraries()
    assert "apt-get update && apt-get install -y --no-install-recommends libnuma1" in str(failed.value)


def test_the_real_script_on_this_machine() -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "system_libs.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_test_that_loads_mooncake_requires_the_libraries_first() -> None:
    uses = re.compile(r'from mooncake\.engine import|"kv_connector": "MooncakeConnector"')
    files = [*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("packages/*/tests/**/test_*.py")]
    users = [f for f in files if uses.search(f.read_text())]
    assert len(users) >= 3, users
    for f in users:
        assert "require_mooncake_libraries()" in f.read_text(), f"{f.relative_to(ROOT)} loads Mooncake unchecked"


def test_readme_ci_and_script_agree() -> None:
    """The README's install line is the script's, .ci/run calls the script only through the README command, and
    the testkit loads the same file."""
    readme = (ROOT / "README.md").read_text()
    everything = libs.apt_command(list(libs.LIBRARIES.values()))
    assert f"`{everything}`" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "dpkg" not in ci, ".ci/run installs through scripts/system_libs.py only"
    assert Path(str(libs.__file__)).resolve() == kit.SCRIPT
    for doc in ("README.md", "packages/npu-kv/README.md"):
        for line in re.findall(r"apt-get install -y[^`]*", (ROOT / doc).read_text()):
            assert set(line.split()[3:]) - {"--no-install-recommends"} == set(libs.LIBRARIES.values()), (doc, line)
