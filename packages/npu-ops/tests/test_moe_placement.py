# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Static expert placement: the replica rule, the per-rank expert maps, and the JSON file's errors."""

from __future__ import annotations

import json

import pytest
import torch
from vllm_npu.interface import ConfigError
from vllm_npu.ops.moe.placement import ExpertPlacement, layer_index, load_expert_map


def test_replica_choice_spreads_tokens_and_agrees_for_offset_zero():
    place = ExpertPlacement(4, [[3, 1, 0], [2, 0, 3]])  # experts 0 and 3 on both ranks
    assert place.num_physical == 6 and place.num_redundant == 2 and place.uniform
    assert place.physical_to_logical.tolist() == [3, 1, 0, 2, 0, 3]
    ids = torch.tensor([[0, 3], [0, 1], [0, 2], [3, 0]])
    physical = place.choose(ids)
    assert bool((place.physical_to_logical[physical] == ids).all())  # always a replica of the routed expert
    # token t takes replica (t + offset) % n: expert 0 alternates between slot 2 (rank 0) and 4 (rank 1)
    assert physical[:, 0].tolist() == [2, 4, 2, 5]
    assert place.choose(ids, offset=1)[:, 0].tolist() == [4, 2, 4, 0]
    assert place.expert_map(1).tolist() == [1, -1, 0, 2]


def test_vllm_maps_round_trip():
    maps = [torch.tensor([0, -1, 1, -1], dtype=torch.int32), torch.tensor([-1, 0, -1, 1], dtype=torch.int32)]
    place = ExpertPlacement.from_expert_maps(maps)
    assert place.slots == [[0, 2], [1, 3]] and place.num_redundant == 0
    assert [place.expert_map(r).tolist() for r in range(2)] == [m.tolist() for m in maps]


@pytest.mark.parametrize(
    ("slots", "match"),
    [([[0, 1], [1, 1]], "twice"), ([[0, 1], [1, 2]], "on no rank"), ([[0, 9], [1, 2, 3]], "outside")],
)
def test_bad_placements_are_named(slots, match):
    with pytest.raises(ConfigError, match=match):
        ExpertPlacement(4, slots)


def _write(tmp_path, layers):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"layer_list": layers}))
    return path


def test_load_expert_map_reads_the_layer_and_names_problems(tmp_path):
    devices = [{"device_id": 1, "device_expert": [2, 3, 0]}, {"device_id": 0, "device_expert": [0, 1]}]
    path = _write(tmp_path, [{"layer_id": 5, "device_count": 2, "device_list": devices}])
    assert load_expert_map(path, layer=5, num_logical=4, world=2).slots == [[0, 1], [2, 3, 0]]
    with pytest.raises(ConfigError, match="no entry with layer_id 4"):
        load_expert_map(path, layer=4, num_logical=4, world=2)
    with pytest.raises(ConfigError, match="3 ranks"):
        load_expert_map(path, layer=5, num_logical=4, world=3)
    with pytest.raises(ConfigError, match="cannot read"):
        load_expert_map(tmp_path / "missing.json", layer=5, num_logical=4, world=2)
    assert layer_index("model.layers.12.mlp.experts") == 12


def test_expert_map_without_expert_parallel_is_a_clear_error(vllm_ctx, tp1_group, tmp_path):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    path = _write(tmp_path, [{"layer_id": 0, "device_list": [{"device_id": 0, "device_expert": [0, 1, 2, 3]}]}])
    vllm_ctx.additional_config = {"npu": {"expert_map_path": str(path)}}
    with pytest.raises(ConfigError, match="enable-expert-parallel"):
        FusedMoE(num_experts=4, top_k=1, hidden_size=8, intermediate_size=4, params_dtype=torch.float32,
                 prefix="model.layers.0.mlp.experts")  # fmt: skip
