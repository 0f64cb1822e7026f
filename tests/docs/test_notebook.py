"""notebooks/ring_attention_colab: the .ipynb matches its jupytext source and runs top to bottom.

The ``.py`` (jupytext percent format) is the source; the ``.ipynb`` is generated
from it and committed without outputs:

  jupytext --to ipynb notebooks/ring_attention_colab.py

The execution test runs the notebook on CPU (8 simulated devices, inherited
from tests/conftest.py through the environment) in a real Jupyter kernel and
fails on the first cell that raises.
"""

import json
import os
import time

import pytest

jupytext = pytest.importorskip("jupytext", reason="pip install -e '.[dev]' (jupytext)")
nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[dev]' (nbformat)")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NB_DIR = os.path.join(ROOT, "notebooks")
PY = os.path.join(NB_DIR, "ring_attention_colab.py")
IPYNB = os.path.join(NB_DIR, "ring_attention_colab.ipynb")
COLAB_URL = ("https://colab.research.google.com/github/ring-jax/ring_jax/blob/main/"
             "notebooks/ring_attention_colab.ipynb")
REGENERATE = "regenerate it: jupytext --to ipynb notebooks/ring_attention_colab.py"


def _cells(nb):
  return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_ipynb_is_in_sync_with_jupytext_source():
  source = jupytext.read(PY)
  committed = nbformat.read(IPYNB, as_version=4)
  assert _cells(committed) == _cells(source), f"the .ipynb is out of date; {REGENERATE}"
  for key in ("accelerator", "colab", "kernelspec"):
    assert committed.metadata.get(key) == source.metadata.get(key), (key, REGENERATE)


def test_ipynb_has_no_outputs_and_asks_for_a_tpu():
  with open(IPYNB) as f:
    raw = json.load(f)
  for cell in raw["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, (
          f"commit the notebook without outputs; {REGENERATE}")
  assert raw["metadata"]["accelerator"] == "TPU"
  assert raw["metadata"]["colab"]["accelerator"] == "TPU"
  assert COLAB_URL in "".join(raw["cells"][0]["source"])  # the "Open in Colab" badge


def test_notebook_runs_top_to_bottom_on_cpu():
  nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' (nbclient)")
  pytest.importorskip("ipykernel", reason="pip install -e '.[dev]' (ipykernel)")
  pytest.importorskip("matplotlib", reason="pip install -e '.[dev]' (matplotlib)")
  nb = nbformat.read(IPYNB, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": NB_DIR}})
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError on the first failing cell
  elapsed = time.perf_counter() - start
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "backend cpu, 8 devices" in text
  assert "max relative error, ring vs dense" in text and "own layer, ring vs dense" in text
  assert "final eval" in text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 2  # the memory plot and the loss curve
  print(f"notebook executed in {elapsed:.0f}s")
