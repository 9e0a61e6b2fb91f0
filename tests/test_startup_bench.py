"""benchmarks/startup.py's checkpoint case on the tiny preset: the checkpoint it writes (one file
per layer, an index) loads as the dummy model it was drawn from, and its disk read counts every
byte of it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import startup
from jpaged.models import checkpoint_tensors, load_model

ROOT = Path(__file__).resolve().parent.parent


def test_written_checkpoint_loads_as_the_dummy_model_and_is_read_whole(tmp_path):
    directory = tmp_path / "tiny_checkpoint"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "startup.py"),
                    "--write-checkpoint", "tiny", "--model-dir", str(directory)],
                   check=True, cwd=ROOT, timeout=600)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in directory.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) == 3  # 2 layers
    loaded = checkpoint_tensors(load_model(directory)[0])
    drawn = checkpoint_tensors(load_model(directory, load_format="dummy")[0])
    assert set(loaded) == set(drawn) == set(index["weight_map"])
    for name, array in drawn.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(array), err_msg=name)
    disk = startup.disk_read(directory)
    assert disk["files"] == 3
    assert disk["gigabytes"] * 1e9 >= index["metadata"]["total_size"]
    assert disk["read_gb_per_s"] > 0
