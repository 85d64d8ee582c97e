"""Each server's BackendManager: two servers in one process keep their own
``--backend-config`` and ``--backend-directory`` (Triton's TritonBackendManager is
per server, core src/backend_manager.cc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trionserve import api
from trionserve._generated.model_config_pb2 import ModelConfig
from trionserve.backends.manager import BackendManager
from trionserve.core.errors import InvalidArgument, Unavailable

# auto_complete_config runs in a stub started with this server's Python settings;
# the model reports the stub's shared-memory arena size (on the stub's command
# line before the growth size and the stub's name, as in Triton's stub_launcher.cc)
# as max_batch_size.
ARENA_MODEL = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        with open("/proc/self/cmdline", "rb") as f:
            arena_bytes = int(f.read().split(b"\\0")[-4])
        config.set_max_batch_size(arena_bytes // 4096)
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]})
        return config

    def execute(self, requests):
        return []
"""


def write_arena_model(repository: Path) -> None:
    (repository / "m" / "1").mkdir(parents=True)
    (repository / "m" / "config.pbtxt").write_text('backend: "python"\n')
    (repository / "m" / "1" / "model.py").write_text(ARENA_MODEL)


def options(repository: Path, arena_bytes: int) -> api.Options:
    return api.Options(
        model_repository=repository,
        model_control_mode=api.ModelControlMode.EXPLICIT,
        backend_configuration={"python": {"shm-default-byte-size": str(arena_bytes)}},
    )


async def test_two_servers_in_one_process_keep_their_own_backend_config(tmp_path):
    write_arena_model(tmp_path)
    # Both servers exist before either loads a model: a process-wide setting
    # would give the first one the second one's arena size.
    async with (
        api.open_server(options(tmp_path, 8 * 4096)) as first,
        api.open_server(options(tmp_path, 16 * 4096)) as second,
    ):
        assert (await first.load("m")).config()["max_batch_size"] == 8
        assert (await second.load("m")).config()["max_batch_size"] == 16


def test_backend_directories_belong_to_their_manager(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    (here / "mine").mkdir(parents=True)
    (here / "mine" / "model.py").write_text("")
    there.mkdir()
    config = ModelConfig(name="m", backend="mine")
    assert BackendManager(directories=[here]).backend_for(config).name == "python"
    with pytest.raises(Unavailable, match="Python-based backend at .*there/mine/model.py"):
        BackendManager(directories=[there]).backend_for(config)


def test_a_bad_python_setting_is_refused_naming_the_flag():
    with pytest.raises(InvalidArgument, match="--backend-config=python,stub-max-restarts"):
        BackendManager({"python": {"stub-max-restarts": "-1"}})
    assert BackendManager().settings_for("python") == {}
