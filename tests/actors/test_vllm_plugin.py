"""The vLLM plugin that stops shared-memory queue readers from spinning
(actors/vllm_plugin.py): installed as vLLM's general plugin, inert unless asked, and
when asked a reader waits on its socket right after a read."""

from __future__ import annotations

import time
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402

from posttrain.actors import vllm_plugin  # noqa: E402
from posttrain.actors.vllm_plugin import SHM_BUSY_LOOP_ENV, busy_loop_seconds  # noqa: E402


class _Reader:
    """A stand-in `SpinCondition` reader: records whether `wait` spun or polled."""

    def __init__(self) -> None:
        self.is_reader = True
        self.busy_loop_s = 1.0
        self.calls: list[str] = []
        self.read_cancel_socket = object()
        self.local_notify_socket = object()
        self.poller = self
        self.last_read = time.monotonic() - 1e-3  # a read just before

    def poll(self, timeout: int | None = None) -> list:
        self.calls.append(f"poll {timeout}")
        return []


@pytest.fixture
def restore_wait():
    original = shm_broadcast.SpinCondition.wait
    yield
    shm_broadcast.SpinCondition.wait = original


def test_installed_as_a_general_plugin() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("posttrain_shm_wait") == "posttrain.actors.vllm_plugin:register"


def test_inert_unless_asked(monkeypatch: pytest.MonkeyPatch, restore_wait) -> None:
    monkeypatch.delenv(SHM_BUSY_LOOP_ENV, raising=False)
    before = shm_broadcast.SpinCondition.wait
    vllm_plugin.register()
    assert shm_broadcast.SpinCondition.wait is before
    reader = _Reader()
    reader.last_read = time.monotonic() + 3600  # within any busy loop
    shm_broadcast.SpinCondition.wait(reader, timeout_ms=5)
    assert reader.calls == []  # vLLM's own: it spins (sched_yield) after a read


def test_asked_a_reader_waits_on_its_socket(monkeypatch: pytest.MonkeyPatch, restore_wait) -> None:
    monkeypatch.setenv(SHM_BUSY_LOOP_ENV, "0")
    vllm_plugin.register()
    vllm_plugin.register()  # twice: one wrapper, over vLLM's own wait
    wait = shm_broadcast.SpinCondition.wait
    assert wait.posttrain_original.__qualname__ == "SpinCondition.wait"
    reader = _Reader()
    wait(reader, timeout_ms=5)
    assert reader.busy_loop_s == 0.0
    assert reader.calls == ["poll 5"]
    # a lost notification costs at most RECHECK_MS, not vLLM's 5 s
    wait(reader, timeout_ms=5000)
    wait(reader, timeout_ms=None)
    assert reader.calls[1:] == [f"poll {vllm_plugin.RECHECK_MS}"] * 2


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "soon"])
def test_bad_values_refused(raw: str) -> None:
    with pytest.raises(ValueError, match=SHM_BUSY_LOOP_ENV):
        busy_loop_seconds({SHM_BUSY_LOOP_ENV: raw})


def test_values() -> None:
    assert busy_loop_seconds({}) is None
    assert busy_loop_seconds({SHM_BUSY_LOOP_ENV: "0"}) == 0.0
    assert busy_loop_seconds({SHM_BUSY_LOOP_ENV: "0.25"}) == 0.25
