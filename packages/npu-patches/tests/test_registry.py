# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The registry's contract on throw-away targets: apply/revert exactly, idempotence, version gate, fingerprint
check, disabling, late registration."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from vllm_npu.interface import ConfigError
from vllm_npu.patches import (
    Patch,
    PatchError,
    PatchFingerprintError,
    PatchRegistry,
    PatchStatus,
    fingerprint_of,
    fingerprint_path,
)
from vllm_npu.patches._model import NOT_CHECKED
from vllm_npu.patches._registry import MARKER

V = "0.11.0"  # the vLLM version the tests pretend is installed


def make_patch(fake, id="shout", attr="greet", factory="shout", scope="worker", vllm=">=0.11.0,<0.12", **kw):
    target = f"{fake.mod.__name__}.{attr}"
    return Patch(
        id=id,
        target=target,
        replacement=fake.fac + factory,
        scope=scope,
        vllm=vllm,
        fingerprint=kw.pop("fingerprint", None) or fingerprint_path(target),
        upstream="https://example.invalid/pr/1",
        reason="test",
        removal="never",
        **kw,
    )


def apply(reg, scope="worker", environ=None, **kw):
    return reg.apply(scope, environ=environ or {}, vllm_version=kw.pop("vllm_version", V), **kw)


def test_apply_then_revert_restores_the_very_same_object(fake):
    original = fake.mod.greet
    reg = PatchRegistry([make_patch(fake)])
    [rec] = apply(reg)
    assert rec.status is PatchStatus.APPLIED
    assert fake.mod.greet("bob") == "HELLO BOB"
    assert getattr(fake.mod.greet, MARKER) == "shout"
    assert rec.original is original
    assert reg.revert() == ["shout"]
    assert fake.mod.greet is original
    assert reg.record("shout").status is PatchStatus.REVERTED


def test_applying_twice_is_harmless(fake):
    reg = PatchRegistry([make_patch(fake)])
    apply(reg)
    patched = fake.mod.greet
    apply(reg)  # second call: same replacement object, not a wrapper of the wrapper
    assert fake.mod.greet is patched
    assert fake.mod.greet("a") == "HELLO A"
    reg.revert()
    reg.revert()  # reverting twice is harmless as well
    assert fake.mod.greet("a") == "hello a"


def test_reapply_after_revert(fake):
    reg = PatchRegistry([make_patch(fake)])
    apply(reg)
    reg.revert()
    apply(reg)
    assert fake.mod.greet("x") == "HELLO X"
    reg.revert()


def test_other_scope_is_left_alone(fake):
    reg = PatchRegistry([make_patch(fake, scope="platform")])
    apply(reg, scope="worker")
    assert reg.record("shout").status is PatchStatus.PENDING
    assert fake.mod.greet("a") == "hello a"
    apply(reg, scope="platform")
    assert fake.mod.greet("a") == "HELLO A"
    reg.revert(scope="worker")
    assert fake.mod.greet("a") == "HELLO A"
    reg.revert(scope="platform")
    assert fake.mod.greet("a") == "hello a"


def test_inherited_method_patched_on_subclass_is_deleted_on_revert(fake):
    reg = PatchRegistry([make_patch(fake, id="child", attr="Child.speak", factory="speak_patched")])
    apply(reg)
    assert fake.mod.Child().speak() == "patched"
    assert fake.mod.Base().speak() == "base"
    reg.revert()
    assert "speak" not in vars(fake.mod.Child)
    assert fake.mod.Child().speak() == "base"


def test_staticmethod_descriptor_is_restored_exactly(fake):
    raw = vars(fake.mod.Base)["static"]
    reg = PatchRegistry([make_patch(fake, id="static", attr="Base.static", factory="static_patched")])
    apply(reg)
    assert fake.mod.Base.static() == "patched static"
    reg.revert()
    assert vars(fake.mod.Base)["static"] is raw
    assert fake.mod.Base.static() == "static"


def test_out_of_range_vllm_skips_with_a_logged_reason(fake, caplog):
    reg = PatchRegistry([make_patch(fake, vllm=">=0.11.0,<0.11.1")])
    with caplog.at_level(logging.INFO, logger="vllm"):
        [rec] = apply(reg, vllm_version="0.11.1")
    assert rec.status is PatchStatus.SKIPPED
    assert rec.reason == "vLLM 0.11.1 is outside the patch's range '>=0.11.0,<0.11.1'"
    assert fake.mod.greet("a") == "hello a"
    assert any("shout" in r.getMessage() and "outside the patch's range" in r.getMessage() for r in caplog.records)


def test_local_version_counts_as_its_release(fake):
    reg = PatchRegistry([make_patch(fake, vllm=">=0.11.0,<0.11.1")])
    [rec] = apply(reg, vllm_version="0.11.0+empty")
    assert rec.status is PatchStatus.APPLIED
    reg.revert()


def test_changed_target_fails_loudly_naming_patch_and_target(fake):
    patch = make_patch(fake)
    fake.rewrite(fake.mod.__loader__.get_source(fake.mod.__name__).replace('"hello "', '"hi "'))
    reg = PatchRegistry([patch])
    with pytest.raises(PatchFingerprintError) as err:
        apply(reg)
    msg = str(err.value)
    assert "'shout'" in msg and f"{fake.mod.__name__}.greet" in msg and "VLLM_NPU_PATCHES=-shout" in msg
    assert err.value.patch_id == "shout" and err.value.target == patch.target
    assert fake.mod.greet("a") == "hi a"  # untouched
    assert reg.record("shout").status is PatchStatus.PENDING


def test_fingerprint_ignores_comments_docstrings_and_formatting(fake):
    before = fingerprint_path(f"{fake.mod.__name__}.greet")
    src = fake.mod.__loader__.get_source(fake.mod.__name__)
    fake.rewrite(
        src.replace('    return "hello " + name', '    # a comment\n\n    return ("hello "   +   name)').replace(
            '"""Say hello."""', '"""Say hello to someone, politely."""'
        )
    )
    assert fake.mod.greet.__doc__ == "Say hello to someone, politely."
    assert fingerprint_path(f"{fake.mod.__name__}.greet") == before


def test_a_changed_dependency_fails_naming_that_path(fake):
    helper = f"{fake.mod.__name__}.helper"
    patch = make_patch(fake, also_checks=((helper, fingerprint_path(helper)),))
    fake.rewrite(fake.mod.__loader__.get_source(fake.mod.__name__).replace("x + 1", "x + 2"))
    with pytest.raises(PatchFingerprintError) as err:
        apply(PatchRegistry([patch]))
    assert err.value.target == helper


def test_a_release_can_move_a_check_to_new_code(fake):
    # 0.11.1 moved a route the patch relies on to another module: from 0.11.1 on the old path is not checked (it is
    # gone) and the new one is, with its own fingerprint; the first release still checks the old path.
    helper, child = f"{fake.mod.__name__}.helper", f"{fake.mod.__name__}.Child"
    patch = make_patch(
        fake,
        also_checks=((helper, "0" * 64),),
        changes=(("0.11.1", ((helper, NOT_CHECKED), (child, fingerprint_path(child)))),),
    )
    assert dict(patch.fingerprints_for("0.11.2")) == {patch.target: patch.fingerprint, child: fingerprint_path(child)}
    with pytest.raises(PatchFingerprintError) as err:
        apply(PatchRegistry([patch]), vllm_version="0.11.0")
    assert err.value.target == helper
    [rec] = apply(PatchRegistry([patch]), vllm_version="0.11.2")
    assert rec.status is PatchStatus.APPLIED


@pytest.mark.parametrize("dropped", ["target", "unchecked"])
def test_a_release_stops_checking_only_paths_checked_before_it(fake, dropped):
    path = f"{fake.mod.__name__}.{'greet' if dropped == 'target' else 'helper'}"
    with pytest.raises(PatchError, match="stop checking"):
        make_patch(fake, changes=(("0.11.1", ((path, NOT_CHECKED),)),))


def test_a_mismatch_changes_nothing_even_for_patches_that_would_fit(fake):
    good = make_patch(fake, id="child", attr="Child.speak", factory="speak_patched")
    bad = make_patch(fake, fingerprint="0" * 64)
    with pytest.raises(PatchFingerprintError):
        apply(PatchRegistry([good, bad]))
    assert "speak" not in vars(fake.mod.Child)


def test_env_disables_one_patch(fake):
    reg = PatchRegistry([make_patch(fake), make_patch(fake, id="child", attr="Child.speak", factory="speak_patched")])
    recs = apply(reg, environ={"VLLM_NPU_PATCHES": "-shout"})
    assert [r.status for r in recs] == [PatchStatus.DISABLED, PatchStatus.APPLIED]
    assert recs[0].reason == "disabled by VLLM_NPU_PATCHES=-shout"
    assert fake.mod.greet("a") == "hello a"
    reg.revert()


def test_env_none_disables_all(fake):
    reg = PatchRegistry([make_patch(fake)])
    [rec] = apply(reg, environ={"VLLM_NPU_PATCHES": "none"})
    assert rec.status is PatchStatus.DISABLED
    assert fake.mod.greet("a") == "hello a"


def test_unknown_id_is_an_error_naming_the_known_ids(fake):
    reg = PatchRegistry([make_patch(fake)])
    with pytest.raises(ConfigError, match=r"unknown patch id\(s\) 'nope'; known ids: shout"):
        apply(reg, environ={"VLLM_NPU_PATCHES": "-nope"})
    with pytest.raises(ConfigError, match=r"item 'shout' must look like -<patch-id>"):
        apply(reg, environ={"VLLM_NPU_PATCHES": "shout"})
    assert fake.mod.greet("a") == "hello a"


def test_additional_config_disables(fake):
    reg = PatchRegistry([make_patch(fake)])
    cfg = SimpleNamespace(additional_config={"npu": {"disabled_patches": ["shout"]}})
    [rec] = apply(reg, vllm_config=cfg)
    assert rec.status is PatchStatus.DISABLED and "additional-config" in rec.reason
    bad = SimpleNamespace(additional_config={"npu": {"disabled_patches": ["typo"]}})
    with pytest.raises(ConfigError, match="--additional-config npu.disabled_patches names unknown patch id"):
        apply(reg, vllm_config=bad)


def test_late_registration_applies_at_once_with_the_same_settings(fake):
    reg = PatchRegistry()
    apply(reg)
    reg.register(make_patch(fake))
    assert reg.record("shout").status is PatchStatus.APPLIED
    assert fake.mod.greet("a") == "HELLO A"
    reg.revert()
    reg2 = PatchRegistry()
    apply(reg2, vllm_version="0.12.0")
    reg2.register(make_patch(fake, id="late"))
    assert reg2.record("late").status is PatchStatus.SKIPPED


def test_duplicate_ids(fake):
    patch = make_patch(fake)
    reg = PatchRegistry([patch])
    reg.register(patch)  # same declaration again: no-op
    assert reg.ids() == ["shout"]
    with pytest.raises(PatchError, match="already registered"):
        reg.register(make_patch(fake, attr="helper"))


def test_revert_refuses_to_clobber_a_later_replacement(fake):
    reg = PatchRegistry([make_patch(fake)])
    apply(reg)
    fake.mod.greet = lambda name: "someone else"
    with pytest.raises(PatchError, match="replaced by something else"):
        reg.revert()


def test_plan_reports_without_applying(fake):
    reg = PatchRegistry([make_patch(fake, vllm="<0.11")])
    assert reg.plan("shout", vllm_version=V)[0] is PatchStatus.SKIPPED
    reg2 = PatchRegistry([make_patch(fake, fingerprint="1" * 64)])
    status, reason = reg2.plan("shout", vllm_version=V)
    assert reason.startswith("fingerprint mismatch")
    assert fake.mod.greet("a") == "hello a"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("id", "Bad_Id", "kebab-case"),
        ("target", "greet", "dotted path"),
        ("replacement", "module.only", "package.module:factory"),
        ("scope", "engine", "scope 'engine'"),
        ("vllm", "0.11", "PEP 440"),
        ("fingerprint", "abc", "64 lowercase hex"),
        ("reason", " ", "reason must be stated"),
        ("removal", "", "removal must be stated"),
    ],
)
def test_declaration_is_validated(field, value, match):
    good = dict(
        id="ok",
        target="vllm.x.f",
        replacement="m:f",
        scope="worker",
        vllm=">=0.11",
        fingerprint="a" * 64,
        upstream="u",
        reason="r",
        removal="r",
    )
    with pytest.raises(PatchError, match=match):
        Patch(**{**good, field: value})


def test_fingerprint_of_non_source_objects_is_stable():
    assert fingerprint_of(3) == fingerprint_of(3) != fingerprint_of(4)
