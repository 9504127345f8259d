"""Head folders refuse what they cannot trust: weights with NaN or inf (at save and load, naming
the tensor and the file), and a head config that names code to run (an MTPC cirkit head's
`circuit: module:function`) unless trust_remote_code; files are replaced atomically; config
fields' docstrings are read back for --help."""

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.gated_lora import load_head as load_gated
from mtpkit.models.gated_lora import save_head as save_gated
from mtpkit.models.atomic_write import replacing, write_atomic
from mtpkit.models.cli_help import field_docs
from mtpkit.models.mtpc import MTPCConfig, MTPCModel
from mtpkit.models.mtpc import load_head as load_mtpc
from mtpkit.models.mtpc import save_head as save_mtpc
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter


def poison(path, name):
    tensors = load_file(str(path))
    key = next(k for k in tensors if name in k)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    return key


@pytest.mark.parametrize("where", ["lora_B", "mask_embeds"])
def test_gated_lora_head_with_nan_is_refused_at_load(tiny, tmp_path, where):
    base, _ = tiny
    save_gated(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path, "tiny-llama-random")
    load_gated(tmp_path, copy.deepcopy(base))  # finite: loads
    file = tmp_path / ("adapter_model.safetensors" if where == "lora_B" else "mtp_head.safetensors")
    key = poison(file, where)
    with pytest.raises(ValueError) as e:
        load_gated(tmp_path, copy.deepcopy(base))
    assert str(file) in str(e.value) and repr(key) in str(e.value) and "\n" not in str(e.value)


def test_gated_lora_save_refuses_nan_and_writes_nothing(tiny, tmp_path):
    base, _ = tiny
    mtp = GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4))
    with torch.no_grad():
        mtp.mask_embeds[0, 0] = float("inf")
    with pytest.raises(ValueError, match="'mask_embeds'"):
        save_gated(mtp, tmp_path / "head", "tiny-llama-random")
    assert not (tmp_path / "head").exists()


def test_mtpc_head_with_nan_is_refused_at_save_and_load(tiny_byte, tmp_path):
    backbone, _ = tiny_byte
    model = MTPCModel(backbone, MTPCConfig(arch="cp", n=4, r=3))
    save_mtpc(model, tmp_path / "ok", "tiny-byte-llama-random")
    key = poison(tmp_path / "ok" / "head.safetensors", "")
    with pytest.raises(ValueError, match=f"head.safetensors: tensor {key!r} has 1 non-finite"):
        load_mtpc(tmp_path / "ok", backbone)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        save_mtpc(model, tmp_path / "bad", "tiny-byte-llama-random")
    assert not (tmp_path / "bad").exists()


@pytest.fixture
def hostile_module(tmp_path, monkeypatch):
    """A module whose circuit builder also writes a marker file (as hostile code would do worse)."""
    marker = tmp_path / "ran.txt"
    (tmp_path / "hostile_circuit.py").write_text(
        "from pathlib import Path\n"
        "from mtpkit.models.mtpc.cirkit_head import linear_tree\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "def build(n, r, V):\n"
        "    return linear_tree(n, r, V)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "hostile_circuit", raising=False)
    return marker


def test_a_head_naming_code_loads_only_with_trust_remote_code(tiny_byte, tmp_path, hostile_module, monkeypatch):
    backbone, _ = tiny_byte
    model = MTPCModel(backbone, MTPCConfig(arch="cirkit", circuit="hostile_circuit:build", n=4, r=3))
    save_mtpc(model, tmp_path / "head", "tiny-byte-llama-random")
    assert json.loads((tmp_path / "head" / "mtpkit_config.json").read_text())["circuit"] == "hostile_circuit:build"
    hostile_module.unlink()
    monkeypatch.delitem(__import__("sys").modules, "hostile_circuit")
    with pytest.raises(ValueError) as e:
        load_mtpc(tmp_path / "head", backbone)
    assert "trust_remote_code" in str(e.value) and "hostile_circuit:build" in str(e.value)
    with pytest.raises(ValueError, match="trust_remote_code"):  # the bench's way in: mtpc:head=DIR
        MTPCDrafter(MTPCDraftConfig(head=str(tmp_path / "head"))).adapt(backbone, {})
    assert not hostile_module.exists()  # nothing was imported
    drafter = MTPCDrafter(MTPCDraftConfig(head=str(tmp_path / "head"), trust_remote_code=True))
    drafter.adapt(backbone, {})
    assert hostile_module.exists() and type(drafter.model.head).__name__ == "CirkitHead"


def test_bench_spec_passes_trust_remote_code():
    from mtpkit.eval.bench import parse_method

    name, options = parse_method("mtpc:head=DIR,trust_remote_code=1")
    assert name == "mtpc" and options.trust_remote_code is True
    assert parse_method("mtpc:head=DIR")[1].trust_remote_code is False


def test_replacing_leaves_the_old_file_on_error(tmp_path):
    path = tmp_path / "trainer_state.json"
    write_atomic(path, '{"step": 1}')
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text('{"st')
            raise RuntimeError("killed mid-write")
    assert path.read_text() == '{"step": 1}' and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    write_atomic(path, b'{"step": 2}')
    assert path.read_text() == '{"step": 2}'


@dataclasses.dataclass
class _Base:
    rate: float = 0.1
    """How fast,
    per step."""
    name: str = "a"
    """The name."""


@dataclasses.dataclass
class _Child(_Base):
    name: str = "b"
    """The child's name."""
    plain: int = 0

    @dataclasses.dataclass
    class Inner:
        depth: int = 1
        """How deep."""


def test_field_docs_read_each_attribute_docstring():
    """Attribute docstrings (what --help prints for every config field), a subclass's own text winning,
    for a nested class and one defined in a function too; read again from the parsed module."""
    @dataclasses.dataclass
    class Local:
        size: int = 2
        """How big."""

    want = {"rate": "How fast, per step.", "name": "The child's name."}
    assert field_docs(_Child) == want and field_docs(_Child) == want  # the second call from the cache
    assert field_docs(_Base)["name"] == "The name."
    assert field_docs(_Child.Inner) == {"depth": "How deep."}
    assert field_docs(Local) == {"size": "How big."}
