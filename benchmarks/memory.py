"""Parameters, state-dict bytes and checkpoint sizes of tied, shared and untied models.

In memory a TiedLinear model and a model whose head is an ``nn.Linear`` given the
embedding's Parameter hold one weight; an untied model holds two. The shared-Parameter
model's state dict lists its weight under two names, which ``safetensors.torch.save_file``
refuses; ``save_model`` drops the duplicate name and writes one copy, and is used for it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from tiny_lm import TinyLM

__all__ = ["run"]

MODELS = {"tied (TiedLinear)": "tied", "shared Parameter": "shared", "untied": "untied"}


def run(quick: bool) -> dict[str, object]:
    """Measure every model, print the table and return the rows (``quick`` changes nothing)."""
    del quick  # nothing here is timed
    vocab, dim = 32000, 512
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        rows = {
            name: _measure(TinyLM(vocab, dim, head), Path(folder)) for name, head in MODELS.items()
        }
    result: dict[str, object] = {
        "model": f"TinyLM(vocab={vocab}, dim={dim}), float32",
        "rows": rows,
    }
    print(_table(result["model"], rows))
    return result


def _measure(model: TinyLM, folder: Path) -> dict[str, object]:
    state_dict = model.state_dict()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_dict.values()
    }
    row: dict[str, object] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "state_dict_keys": len(state_dict),
        "state_dict_bytes": sum(t.numel() * t.element_size() for t in state_dict.values()),
        "state_dict_distinct_storage_bytes": sum(storages.values()),
    }
    path = folder / "model.safetensors"
    try:
        safetensors.torch.save_file(state_dict, path)
        row["safetensors_how"] = "save_file(model.state_dict())"
    except RuntimeError as error:
        row["save_file_error"] = " ".join(str(error).split())
        safetensors.torch.save_model(model, str(path))
        row["safetensors_how"] = (
            "save_file(model.state_dict()) refuses the shared tensors; "
            "save_model(model) drops the duplicate key and saves one copy"
        )
    row["safetensors_bytes"] = path.stat().st_size
    torch_path = folder / "model.pt"
    torch.save(state_dict, torch_path)
    row["torch_save_bytes"] = torch_path.stat().st_size
    return row


def _table(model: object, rows: dict[str, dict[str, object]]) -> str:
    lines = [
        f"Memory, {model}:",
        "",
        "| model | parameters | state_dict keys | state_dict bytes (entries) "
        "| distinct storage bytes | safetensors file | torch.save file |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['parameters']:,} | {row['state_dict_keys']} | "
            f"{row['state_dict_bytes']:,} | {row['state_dict_distinct_storage_bytes']:,} | "
            f"{row['safetensors_bytes']:,} | {row['torch_save_bytes']:,} |"
        )
    for name, row in rows.items():
        if "save_file_error" in row:
            lines += [
                "",
                f"{name}: {row['safetensors_how']} (save_file said: {row['save_file_error']})",
            ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="accepted; nothing here is timed")
    run(parser.parse_args().quick)
