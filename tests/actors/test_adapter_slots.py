"""`AdapterSlots`, the named adapters' least-recently-used table, and the vLLM LoRA
options it sizes (actors/adapter_slots.py): hand-checked orders, no engine."""

from __future__ import annotations

import pytest

from posttrain.actors.adapter_slots import AdapterSlots, vllm_lora_options


def test_a_full_table_releases_the_least_recently_used():
    slots = AdapterSlots(2)
    assert slots.make_room("a") == []
    slots.put("a", 1, "k1")
    slots.put("b", 1, "k2")
    assert slots.use("a").key == "k1"  # a used after b: b is now the oldest
    released = slots.make_room("c")
    assert [(s.name, s.key) for s in released] == [("b", "k2")]
    slots.put("c", 4, "k3")
    assert slots.names() == ["a", "c"]
    with pytest.raises(ValueError, match="'b' was evicted .*2 adapters.*push it again"):
        slots.use("b")
    slots.make_room("b")  # pushed again: it comes back, a is released
    slots.put("b", 2, "k4")
    assert slots.names() == ["c", "b"] and slots.peek("b").version == 2


def test_a_new_version_replaces_its_name_without_evicting_another():
    slots = AdapterSlots(2)
    slots.put("a", 1, "k1")
    slots.put("b", 1, "k2")
    assert [s.key for s in slots.make_room("a")] == ["k1"]  # only its own old version
    slots.put("a", 2, "k3")
    assert slots.names() == ["b", "a"] and slots.peek("a").version == 2


def test_dropped_and_unknown_names_say_so_and_ids_never_repeat():
    slots = AdapterSlots(1)
    slots.put("a", 1, "k1")
    assert slots.pop("a").key == "k1" and slots.pop("a") is None and len(slots) == 0
    with pytest.raises(ValueError, match="'a' is not loaded on this engine"):
        slots.use("a")
    assert [slots.new_id() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="max_adapters must be at least 1, got 0"):
        AdapterSlots(0)


@pytest.mark.parametrize(("rank", "fit"), [(1, 1), (4, 8), (8, 8), (9, 16), (512, 512)])
def test_vllm_slots_take_the_next_rank_up_and_hold_max_adapters(rank, fit):
    assert vllm_lora_options(rank, 3) == {
        "enable_lora": True,
        "max_lora_rank": fit,
        "max_loras": 3,
        "max_cpu_loras": 3,
    }


def test_vllm_ranks_above_512_are_refused():
    with pytest.raises(ValueError, match="r 513 is above vLLM's largest LoRA rank 512"):
        vllm_lora_options(513, 1)
