# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The CANN detector shared by the device probe and ``vllm-npu doctor``."""

from __future__ import annotations

from pathlib import Path

from vllm_npu.interface.cann import CannHome, find_cann_home


def test_variables_first_then_opp_parent_then_defaults(tmp_path: Path) -> None:
    toolkit, home, opp_home, default = (tmp_path / n for n in ("toolkit", "home", "opp_home", "default"))
    for d in (toolkit, home, opp_home / "opp", default):
        d.mkdir(parents=True)
    env = {"ASCEND_TOOLKIT_HOME": str(toolkit), "ASCEND_HOME_PATH": str(home), "ASCEND_OPP_PATH": f"{opp_home}/opp/"}
    defaults = (str(default),)
    searched = (str(toolkit), str(home), str(opp_home), str(default))
    assert find_cann_home(env, defaults) == CannHome(str(toolkit), "ASCEND_TOOLKIT_HOME", searched)
    del env["ASCEND_TOOLKIT_HOME"]
    assert find_cann_home(env, defaults) == CannHome(str(home), "ASCEND_HOME_PATH", searched[1:])
    del env["ASCEND_HOME_PATH"]
    assert find_cann_home(env, defaults) == CannHome(str(opp_home), "ASCEND_OPP_PATH", searched[2:])
    assert find_cann_home({}, defaults) == CannHome(str(default), "default location", searched[3:])


def test_a_variable_naming_a_missing_directory_is_no_install(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone")
    env = {"ASCEND_HOME_PATH": gone, "ASCEND_OPP_PATH": f"{gone}/opp"}
    assert find_cann_home(env, default_homes=()) == CannHome(None, None, (gone, gone))
