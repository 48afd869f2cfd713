"""``ckptd import dcp`` and ``ckptd export`` (:mod:`ckptd.cli.dcp_io`) over a real root, in process
(``ckptd.cli.main.main``), from a directory ``torch.distributed.checkpoint.save`` wrote in this
process: exit codes, what is printed and what is written, never a traceback.

* an import commits the DCP checkpoint (one line, or the figures as JSON); exported again as one
  torch.save file it is the state dict DCP saved, nested, bit for bit, objects included;
* a safetensors export holds the model's weights without their ``model.`` prefix by default and says
  what it left out; ``--prefix ''`` exports every tensor, and ``--dtype`` casts the floating ones;
* a bad ref is refused before anything is read or written (exit 2, no root made), a directory that
  is not a DCP checkpoint or a truncated one is exit 1 naming the file, with nothing imported; an
  export of a checkpoint that is not there is exit 1, a shard size that does not parse exit 2.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptd.cli.dcp_io import CAST_DTYPES, add_parsers, cmd_export, cmd_import_dcp
from ckptd.cli.main import main
from ckptd.cli.target import add_target
from support import assert_bits_equal


def _state() -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.full((4,), 1.5, dtype=torch.bfloat16)},
            "optim": {"m": torch.arange(12.0).reshape(3, 4) / 7}, "step": 7}


@pytest.fixture
def dcp_dir(tmp_path) -> Path:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that no process group is set up: one process saves
        dcp.save(_state(), checkpoint_id=str(out), no_dist=True)
    return out


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "root"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def test_the_modules_commands_are_its_parsers(dcp_dir, root, capsys):
    parser = argparse.ArgumentParser(prog="ckptd")
    add_parsers(parser.add_subparsers(dest="command"), add_target)
    args = parser.parse_args(["import", "dcp", str(dcp_dir), "imp/3", "--json", "--root", str(root)])
    assert args.func is cmd_import_dcp and cmd_import_dcp(args) == 0
    assert json.loads(capsys.readouterr().out)["ref"] == "imp/3"
    args = parser.parse_args(["export", "imp/3", "out"])
    assert args.func is cmd_export and args.format == "safetensors" and args.max_shard_size == "5GB"
    assert "bfloat16" in CAST_DTYPES and "int64" not in CAST_DTYPES  # --dtype casts floating tensors only


def test_an_import_commits_and_exports_back_as_dcp_saved_it(dcp_dir, root, tmp_path, capsys):
    rc, out, err = _run(capsys, "import", "dcp", str(dcp_dir), "imp/7", "--root", str(root))
    assert rc == 0, err
    assert out.startswith(f"committed imp/7 from DCP checkpoint {dcp_dir}: 3 tensors (3 chunks), 1 objects")
    assert (root / "runs" / "imp" / "7" / "COMMITTED").exists()
    rc, out, _ = _run(capsys, "import", "dcp", str(dcp_dir), "imp/8", "--root", str(root), "--json")
    figures = json.loads(out)
    assert rc == 0 and (figures["ref"], figures["tensors"], figures["objects"], figures["files"]) == ("imp/8", 3, 1, 1)
    assert figures["source"] == str(dcp_dir) and figures["bytes_written"] > 0

    pt = tmp_path / "out.pt"
    rc, out, _ = _run(capsys, "export", "imp/7", "--format", "torch", str(pt), "--root", str(root), "--json")
    res = json.loads(out)
    assert rc == 0 and res["format"] == "torch" and res["nested"] is True and res["checked"] is True
    assert_bits_equal(torch.load(pt, weights_only=True), _state())


def test_safetensors_exports_the_model_by_default_and_casts_on_request(dcp_dir, root, tmp_path, capsys):
    assert _run(capsys, "import", "dcp", str(dcp_dir), "imp/7", "--root", str(root))[0] == 0
    rc, out, _ = _run(capsys, "export", "imp/7", str(tmp_path / "st"), "--root", str(root))
    assert rc == 0 and "the 2 tensors under 'model.' (without it)" in out and "the other 1 tensors" in out
    [shard] = sorted((tmp_path / "st").glob("*.safetensors"))
    got = load_file(shard)
    assert sorted(got) == ["b", "w"]
    assert_bits_equal(got, _state()["model"])
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"b", "w"}

    rc, out, _ = _run(capsys, "export", "imp/7", str(tmp_path / "all"), "--prefix", "", "--dtype", "bfloat16",
                      "--root", str(root), "--json")
    assert rc == 0 and json.loads(out)["tensors"] == 3
    got = load_file(next((tmp_path / "all").glob("*.safetensors")))
    assert {k: v.dtype for k, v in got.items()} == {"model.w": torch.bfloat16, "model.b": torch.bfloat16,
                                                     "optim.m": torch.bfloat16}
    assert torch.equal(got["optim.m"], _state()["optim"]["m"].to(torch.bfloat16))


def test_bad_input_is_refused_and_nothing_is_imported(dcp_dir, root, tmp_path, capsys):
    rc, out, err = _run(capsys, "import", "dcp", str(dcp_dir), "Bad/1", "--root", str(root))
    assert rc == 2 and out == "" and "invalid run 'Bad'" in err and not root.exists()
    rc, _, err = _run(capsys, "import", "dcp", str(tmp_path / "nothing"), "imp/1", "--root", str(root))
    assert rc == 1 and "is not a directory" in err and not root.exists()
    data = dcp_dir / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    rc, _, err = _run(capsys, "import", "dcp", str(dcp_dir), "imp/1", "--root", str(root))
    assert rc == 1 and f"{data} is truncated" in err and "nothing was imported" in err and not root.exists()
    assert err.count("\n") == 1


def test_an_export_of_nothing_or_to_a_bad_size_is_refused(dcp_dir, root, tmp_path, capsys):
    assert _run(capsys, "import", "dcp", str(dcp_dir), "imp/7", "--root", str(root))[0] == 0
    rc, _, err = _run(capsys, "export", "imp/77", str(tmp_path / "x"), "--root", str(root))
    assert rc == 1 and "imp/77" in err and not (tmp_path / "x").exists()
    rc, _, err = _run(capsys, "export", "imp/7", str(tmp_path / "y"), "--max-shard-size", "lots", "--root", str(root))
    assert rc == 2 and "invalid size 'lots'" in err and not (tmp_path / "y").exists()
