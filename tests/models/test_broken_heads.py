"""A head folder with a truncated or corrupt file (an interrupted download or copy) fails with one
line naming that file: the safetensors weights, mtpkit_config.json, peft's adapter_config.json."""

import copy
import json
from pathlib import Path

import pytest

from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.gated_lora import load_head as load_gated
from mtpkit.models.gated_lora import save_head as save_gated
from mtpkit.models.head_folder import read_head_config, read_weights
from mtpkit.models.mtpc import MTPCConfig, MTPCModel
from mtpkit.models.mtpc import load_head as load_mtpc
from mtpkit.models.mtpc import save_head as save_mtpc


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _one_line_naming(error, path) -> None:
    text = str(error.value)
    assert str(path) in text and "\n" not in text, text


@pytest.fixture
def gated_head(tiny, tmp_path):
    base, _ = tiny
    save_gated(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path / "gated", "tiny-llama-random")
    load_gated(tmp_path / "gated", copy.deepcopy(base))  # intact: loads
    return tmp_path / "gated"


@pytest.fixture
def mtpc_head(tiny_byte, tmp_path):
    save_mtpc(MTPCModel(tiny_byte[0], MTPCConfig(arch="cp", n=4, r=3)), tmp_path / "mtpc", "tiny-byte-llama-random")
    load_mtpc(tmp_path / "mtpc", tiny_byte[0])
    return tmp_path / "mtpc"


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "mtp_head.safetensors"])
def test_truncated_gated_lora_weights_name_the_file(tiny, gated_head, name):
    truncate(gated_head / name)
    with pytest.raises(ValueError, match="truncated or corrupt") as e:
        load_gated(gated_head, copy.deepcopy(tiny[0]))
    _one_line_naming(e, gated_head / name)


def test_truncated_mtpc_weights_name_the_file(tiny_byte, mtpc_head):
    truncate(mtpc_head / "head.safetensors")
    with pytest.raises(ValueError, match="truncated or corrupt") as e:
        load_mtpc(mtpc_head, tiny_byte[0])
    _one_line_naming(e, mtpc_head / "head.safetensors")


def test_missing_weights_name_the_file(tiny_byte, mtpc_head):
    (mtpc_head / "head.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_mtpc(mtpc_head, tiny_byte[0])
    _one_line_naming(e, mtpc_head / "head.safetensors")


@pytest.mark.parametrize("text", ['{"method": "mtpc", "arch": ', b"\xff\xfe{"])
def test_broken_head_config_names_the_file(tiny_byte, mtpc_head, text):
    config = mtpc_head / "mtpkit_config.json"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load_mtpc(mtpc_head, tiny_byte[0])
    _one_line_naming(e, config)


def test_head_config_with_wrong_settings_names_the_file(tiny, tiny_byte, gated_head, mtpc_head):
    (gated_head / "mtpkit_config.json").write_text('{"method": "gated_lora", "k": 2}')
    with pytest.raises(ValueError, match='no valid "gated_lora" settings') as e:
        load_gated(gated_head, copy.deepcopy(tiny[0]))
    _one_line_naming(e, gated_head / "mtpkit_config.json")
    config = read_head_config(mtpc_head)
    (mtpc_head / "mtpkit_config.json").write_text(json.dumps(config | {"arch": "tree"}))
    with pytest.raises(ValueError, match="arch must be one of") as e:
        load_mtpc(mtpc_head, tiny_byte[0])
    _one_line_naming(e, mtpc_head / "mtpkit_config.json")


def test_broken_peft_adapter_config_names_the_file(tiny, gated_head):
    (gated_head / "adapter_config.json").write_text("{bad")
    with pytest.raises(ValueError, match="not valid JSON") as e:
        load_gated(gated_head, copy.deepcopy(tiny[0]))
    _one_line_naming(e, gated_head / "adapter_config.json")


def test_read_weights_reads_an_intact_file(mtpc_head):
    assert read_weights(mtpc_head / "head.safetensors")
