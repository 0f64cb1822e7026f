"""The benchmarks measure shipped code: the all-gather strategy they compare with and its
model backend (the registry's), the train-throughput script, the peak-FLOP/s table, and the
imports the accelerator image (no ml_collections, no grain) needs."""
import os
import subprocess
import sys
import textwrap
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ring_jax
from model_utils import graphdef, make_mesh, packed_batch, random_params
from models import attention as attn_lib
from models import sharding as shd
from models.llama import LlamaConfig
from ring_jax import hardware
import train_procs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize("layout,is_causal,segments", [("contiguous", True, False),
                                                       ("zigzag", True, True),
                                                       ("striped", False, False)])
def test_allgather_baseline_matches_dense(layout, is_causal, segments):
  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sequence",))
  ks = jax.random.split(jax.random.key(0), 4)
  b, l, nh, kh, h = 1, 64, 4, 2, 16
  q = jax.random.normal(ks[0], (b, l, nh, h), jnp.float32)
  k = jax.random.normal(ks[1], (b, l, kh, h), jnp.float32)
  v = jax.random.normal(ks[2], (b, l, kh, h), jnp.float32)
  do = jax.random.normal(ks[3], (b, l, nh, h), jnp.float32)
  # Three documents and trailing padding (segment 0), or none.
  seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], 16, axis=1), jnp.int32) if segments else None

  def loss(f, q, k, v):
    return jnp.sum(f(q, k, v) * do)

  ag = lambda q, k, v: ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="all_gather",
                                                   batch_axis=None, head_axis=None,
                                                   is_causal=is_causal,
                                                   segment_ids=seg, layout=layout, block_q=4,
                                                   block_kv=4)
  ref = lambda q, k, v: ring_jax.reference_attention(q, k, v, is_causal=is_causal,
                                                     segment_ids=seg)
  chex.assert_trees_all_close(jax.jit(ag)(q, k, v), ref(q, k, v), atol=2e-5, rtol=2e-5)
  g = jax.jit(jax.grad(lambda *a: loss(ag, *a), argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
  chex.assert_tree_all_finite(g)
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_attention_registry():
  """One table; registering is one entry; a taken name is not silently replaced."""
  assert set(attn_lib.ATTENTION_BACKENDS) >= {"ring", "all_gather", "ulysses", "hybrid", "auto",
                                              "dense"}
  name = "all_gather"
  backend = attn_lib.ATTENTION_BACKENDS[name]
  attn_lib.register_attention(name, backend)  # the same function again: a no-op
  with pytest.raises(ValueError, match="already registered"):
    attn_lib.register_attention(name, attn_lib.dense)
  assert LlamaConfig(attention=name).attention == name
  with pytest.raises(ValueError, match="register_attention"):
    LlamaConfig(attention="flash")


def test_allgather_backend_in_the_model_matches_dense():
  """LlamaConfig(attention="all_gather") on a data=2 x sequence=4 mesh (zigzag, GQA, packed
  documents with padding) == the dense backend on one device: logits and gradients."""
  tiny = dict(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64,
              init_std=0.2)
  dense_cfg = LlamaConfig(**tiny, attention="dense")
  ag_cfg = LlamaConfig(**tiny, attention="all_gather", layout="zigzag", block_q=2, block_kv=2)
  params = random_params(dense_cfg)
  tokens, pos, segs = packed_batch(64, ((5, 7), (9, 3, 4)), 16)
  weights = np.random.default_rng(1).normal(size=(2, 16, 64)).astype(np.float32) / 32
  weights *= (segs > 0)[..., None]

  def grads(cfg, p, *batch):
    def loss(p, t, q, s, w):
      return jnp.sum(nnx.merge(graphdef(cfg), p)(t, q, s) * w)
    return jax.jit(jax.value_and_grad(loss))(p, *batch)

  want_loss, want = grads(dense_cfg, params, tokens, pos, segs, weights)
  mesh = make_mesh(data=2, sequence=4)
  to = lambda x: np.asarray(ring_jax.to_layout(x, "zigzag", 4))
  with jax.set_mesh(mesh):
    got_loss, got = grads(ag_cfg, jax.device_put(params, shd.param_shardings(params, mesh)),
                          to(tokens), to(pos), to(segs), to(weights))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              rtol=1e-5, atol=1e-5)


def test_train_throughput_runs_the_shipped_step():
  """Tiny shapes, one timed step per backend: both run, and give the same loss (the same
  model, step and batch; only the attention implementation differs). The dense backend is
  compared with the all-gather one above, at less cost than a third compile here."""
  from benchmarks import train_throughput

  results = train_throughput.main([
      "--seq-len", "64", "--dim", "32", "--mlp-dim", "64", "--num-heads", "4",
      "--num-kv-heads", "2", "--vocab-size", "64", "--num-layers", "1", "--steps", "1",
      "--mesh", "data=2,sequence=4", "--batch", "2", "--peak-tflops", "1",
      "--attention", "ring,all_gather"])
  assert [r["attention"] for r in results] == ["ring", "all_gather"]
  for r in results:
    assert "error" not in r, r
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
  np.testing.assert_allclose([r["loss"] for r in results], results[0]["loss"], rtol=1e-5)


def test_balance_dry_run(tmp_path):
  """benchmarks/balance.py --dry-run: 2 processes, one device and one core each, gloo
  collectives; every requested implementation gets a positive time from both processes
  (the paper's code too when the bench extra is installed), and the JSON matches the table."""
  import json

  from benchmarks import balance

  try:
    from benchmarks import attention
    attention.import_paper()
    impls = ["ring-contiguous", "ring-zigzag", "paper"]
  except ImportError:
    impls = ["ring-contiguous", "ring-zigzag"]
  result = balance.main(["--dry-run", "--lengths", "128", "--impls", ",".join(impls),
                         "--out", str(tmp_path), "--timeout", "500"])
  assert result["processes"] == 2 and result["dry_run"] and result["lengths"] == [128]
  assert [sorted(a) for a in result["affinity"]] == [[c] for c in result["cores"]]
  assert [r["impl"] for r in result["rows"]] == impls
  for r in result["rows"]:
    assert r["median_s"] > 0 and len(r["per_process_median_s"]) == 2
    assert r["median_s"] == max(r["per_process_median_s"])  # one repetition: the slowest
  zigzag, contiguous = result["rows"][1], result["rows"][0]
  assert zigzag["critical_path_hops"] < contiguous["critical_path_hops"]
  with open(tmp_path / "balance_cpu.json") as f:
    assert json.load(f)["rows"] == result["rows"]
  assert "ring-zigzag" in (tmp_path / "balance_cpu.log").read_text()


def test_ring_variant_names_the_routing():
  """``ring-<layout>[+routed|+full][:kernel]``: no suffix is the library default (None)."""
  from benchmarks.attention import ring_variant

  assert ring_variant("ring-contiguous") == ("contiguous", "auto", None)
  assert ring_variant("ring-contiguous+full") == ("contiguous", "auto", False)
  assert ring_variant("ring-zigzag+routed:xla") == ("zigzag", "xla", True)
  with pytest.raises(ValueError, match="suffix after"):
    ring_variant("ring-zigzag+fast")


def test_packed_balance_dry_run(tmp_path):
  """benchmarks/balance.py packed --dry-run: the document layout balances the block pairs
  the kernels compute per device where zigzag does not, and the JSON and log are written."""
  import json

  from benchmarks import balance

  result = balance.main(["packed", "--dry-run", "--out", str(tmp_path)])
  for fig in result["means"].values():
    assert fig["document"]["block_max_over_mean"]["max"] <= 1.10
    assert fig["zigzag"]["block_max_over_mean"]["median"] > 1.3
    assert (fig["document"]["token_max_over_mean"]["median"]
            < fig["zigzag"]["token_max_over_mean"]["median"])
  with open(tmp_path / "packed_balance.json") as f:
    assert json.load(f)["means"] == result["means"]
  assert "document" in (tmp_path / "packed_balance.log").read_text()


def test_compile_time_dry_run(tmp_path):
  """benchmarks/compile_time.py --dry-run: two attention cases at 256 tokens, one compile
  each; the program sizes, compile seconds and temp memory land in the JSON with its
  metadata."""
  import json

  from benchmarks import compile_time

  out = tmp_path / "compile_time.json"
  result = compile_time.main(["--dry-run", "--out", str(out)])
  assert [(r["causal"], r["layout"]) for r in result["attention"]] == [
      (True, "zigzag"), (False, "contiguous")]
  for r in result["attention"]:
    assert r["hlo_instructions"] > 0 and r["hlo_lines"] > r["hlo_instructions"]
    assert len(r["compile_s"]) == 1 and r["compile_median_s"] > 0
    assert 0 < r["fwd_temp_bytes"] <= r["fwdbwd_temp_bytes"]
  saved = json.loads(out.read_text())
  assert saved["attention"] == result["attention"] and saved["meta"]["dry_run"]
  assert "train_step" not in saved and saved["meta"]["jax"] == jax.__version__


def test_compile_time_strategy_memory(tmp_path):
  """benchmarks/compile_time.py strategy: per strategy the compiled fwd and fwd+bwd temp
  memory and ring_jax.plan's figure for the same call, in the result file with its command."""
  import json

  from benchmarks import compile_time

  out = tmp_path / "strategy.json"
  result = compile_time.main(["strategy", "--length", "512", "--out", str(out)])
  assert [r["strategy"] for r in result["rows"]] == ["ring", "ulysses", "all_gather"]
  for r in result["rows"]:
    assert 0 < r["fwd_temp_bytes"] <= r["fwdbwd_temp_bytes"] and r["plan_memory_bytes"] > 0
  saved = json.loads(out.read_text())
  assert saved["rows"] == result["rows"] and saved["length"] == 512
  assert saved["meta"]["command"].startswith("python benchmarks/compile_time.py strategy")


def test_layout_host_time_small_batch():
  """benchmarks/layout_host_time.py on a small batch: a row per shape and layout, times
  positive; the batch it times has the pipeline's fields and packs several documents per
  row, which the document layout only reorders row by row."""
  import numpy as np

  from benchmarks import layout_host_time
  from training import data as data_lib

  rows = layout_host_time.main(["--shapes", "2x256", "--ring", "4", "--mean", "40",
                                "--reps", "2"])
  assert [(r["shape"], r["layout"]) for r in rows] == [("2x256", "zigzag"),
                                                       ("2x256", "document")]
  assert all(r["median_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
  batch = layout_host_time.packed_batch(np.random.default_rng(0), 2, 256, 40)
  assert set(batch) == set(data_lib.FIELDS) and batch["segment_ids"].max() > 2
  out = data_lib.to_layout_np(batch, "document", 4)
  np.testing.assert_array_equal(np.sort(out["tokens"], axis=1), np.sort(batch["tokens"], axis=1))


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s: one table
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,flops", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12),
    ("TPU v4", 275e12), ("NVIDIA GB200", 2.5e15), ("NVIDIA B200", 2.25e15),
])
def test_peak_flops_table(kind, flops):
  assert hardware.peak_flops(kind) == flops
  assert hardware.device_spec(kind).source


def test_peak_flops_unknown_and_table_shape():
  assert hardware.peak_flops("cpu") is None
  assert hardware.peak_flops("Some Future Chip") is None
  matches = [d.match.lower() for d in hardware.DEVICES]
  assert len(set(matches)) == len(matches)
  # A more specific name never comes after a substring of it (it could never match).
  for i, m in enumerate(matches):
    assert not any(earlier in m for earlier in matches[:i]), m


def test_trainer_mfu_uses_the_table():
  from training import metrics

  config = types.SimpleNamespace(get=lambda k: None, cpu_peak_flops_per_device=1.0)
  h200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
  flops, source = metrics.peak_flops_per_device(config, h200)
  assert flops == hardware.peak_flops("NVIDIA H200") and "H200" in source
  with pytest.raises(ValueError, match="peak_flops_per_device"):
    metrics.peak_flops_per_device(config, types.SimpleNamespace(platform="gpu",
                                                                device_kind="Mystery"))


# ----------------------------------------------------------------------------------------------
# The accelerator image has no ml_collections and no grain
# ----------------------------------------------------------------------------------------------


def test_gpu_check_measures_the_shipped_long_config():
  """accelerator_check.py's model is configs/llama_1b.py:long's (read without ml_collections),
  its
  layout="auto" resolved as train.py resolves it on one device."""
  from benchmarks import accelerator_check
  from configs import llama_1b
  from models.llama import LlamaConfig
  from training import validation as val_lib

  for arg in (None, "text", "long"):
    fields = llama_1b.model_fields(arg)
    resolved, _ = val_lib.resolve_layout(llama_1b.get_config(arg), ring_size=16)
    assert fields["layout"] == "auto"
    assert (LlamaConfig.from_dict({**fields, "layout": resolved.model.layout})
            == val_lib.llama_config(resolved))
  one_device, _ = val_lib.resolve_layout(llama_1b.get_config("long"), ring_size=1)
  assert accelerator_check.llama_config() == val_lib.llama_config(one_device)


def test_models_and_train_step_import_without_ml_collections_and_grain():
  """models/*, training/step.py, training/batch.py and the benchmarks import (and build a
  model) in a fresh interpreter where ml_collections and grain cannot be imported."""
  code = textwrap.dedent("""
      import sys

      class Block:
          BLOCKED = ("ml_collections", "grain")

          def find_spec(self, name, path=None, target=None):
              if name.split(".")[0] in self.BLOCKED:
                  raise ImportError(f"{name} is blocked for this test")
              return None

      sys.meta_path.insert(0, Block())
      import models, models.attention, models.convert_hf, models.llama, models.sharding
      import models.lengths, training.batch, training.step
      import benchmarks.common, benchmarks.accelerator_check
      import benchmarks.train_throughput
      from flax import nnx
      benchmarks.accelerator_check.llama_config()  # reads configs/llama_1b.py, no ml_collections
      cfg = models.LlamaConfig(vocab_size=16, dim=8, num_layers=1, num_heads=2,
                               num_kv_heads=1, mlp_dim=16)
      nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))
      try:
          import ml_collections
      except ImportError:
          print("blocked ok")
      """)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "blocked ok" in proc.stdout


def test_attention_block_sweep(tmp_path, capsys):
  """benchmarks/attention.py --sections sweep: every candidate block that divides the
  layout's chunk is timed (fwd+bwd) with its temp memory, the default is marked, the best
  block is 1.00x, and --render prints the markdown table from the JSON."""
  import json

  from benchmarks import attention
  from ring_jax.ring import default_block

  attention.main(["--sections", "sweep", "--sweep-lengths", "128", "--sweep-blocks", "8,32",
                  "--layouts", "zigzag", "--masks", "causal", "--variants", "ring",
                  "--ring", "2", "--sweep-repeats", "1", "--heads", "2", "--head-dim", "8",
                  "--out", str(tmp_path), "--tag", "sweep"])
  with open(tmp_path / "sweep.json") as f:
    rows = json.load(f)["sweep"]
  by_layout = {}
  for r in rows:
    by_layout.setdefault(r["layout"], {})[r["block"]] = r
  # local 64: zigzag chunks of 32, so blocks 8 and 32 (the default: the whole chunk)
  blocks = by_layout.pop("zigzag")
  assert not by_layout and sorted(blocks) == [8, 32] and default_block("zigzag", 64) == 32
  assert [b for b, r in blocks.items() if r["is_default"]] == [32]
  assert min(r["x_best"] for r in blocks.values()) == 1.0
  assert all(r["fwdbwd_median_s"] > 0 and r["fwdbwd_mem"]["temp_size_in_bytes"] > 0
             for r in blocks.values())
  capsys.readouterr()
  attention.main(["--render", str(tmp_path / "sweep.json")])
  table = capsys.readouterr().out
  assert "| L | mask | layout | 8 | 32 |" in table and "| 128 | causal | zigzag | " in table


def test_two_level_matrix_cells_and_compare(tmp_path, capsys):
  """benchmarks/two_level.py matrix: 22 cells per ring and pass (document takes no window);
  --compare counts a cell equal, better or worse from its figures and exits 1 on a worse one
  or a missing one."""
  import json

  from benchmarks import two_level

  cells = list(two_level.cells(["2"], two_level.LAYOUTS, two_level.MASKS, ["fwd"]))
  assert len(cells) == 22 and not any(c["layout"] == "document" and c["mask"] == "window"
                                      for c in cells)
  base = [dict(c, permutes=4, permute_bytes=100, temp_bytes=10, hlo_chars=50)
          for c in cells[:3]]
  after = [dict(base[0]), dict(base[1], permutes=2), dict(base[2], temp_bytes=11)]
  paths = []
  for name, rows in (("before", base), ("after", after), ("short", after[:2])):
    paths.append(tmp_path / f"{name}.json")
    paths[-1].write_text(json.dumps(dict(rows=rows)))
  capsys.readouterr()
  assert two_level.main(["matrix", "--compare", str(paths[0]), str(paths[1])]) == 1
  out = capsys.readouterr().out
  assert "3 cells: 1 equal, 1 better, 1 worse" in out and "temp_bytes 10 -> 11 WORSE" in out
  assert two_level.main(["matrix", "--compare", str(paths[0]), str(paths[0])]) == 0
  assert two_level.main(["matrix", "--compare", str(paths[0]), str(paths[2])]) == 1
  assert "missing after" in capsys.readouterr().out


def test_hop_profile_attributes_the_ring_by_kind_and_part():
  """benchmarks/hop_profile.py: the compiled HLO's block matmuls are 'matmul' inside the hop
  kernel's named loops, and a profiled ring's time lands in those kinds and parts."""
  from benchmarks import hop_profile

  r = hop_profile.profile(length=64, layout="zigzag", causal=True, block=None, ring=2,
                          heads=2, head_dim=8, steps=1)
  assert set(r["by_kind_ms"]) == set(hop_profile.KINDS)
  assert r["by_kind_ms"]["matmul"] > 0 and r["by_kind_ms"]["exp"] > 0
  parts = r["by_part_ms"]
  assert parts["fwd: xla_hop_fwd_blocks"] > 0 and parts["bwd: xla_hop_bwd_blocks"] > 0
  assert parts["fwd: merge"] > 0


def test_plot_results_draws_the_result_files(tmp_path):
  """The docs' plots come from the committed result files: the series are the files'
  numbers, and every PNG is written."""
  sys.path.insert(0, ROOT)
  from benchmarks import plot_results
  import json
  with open(os.path.join(plot_results.RESULTS, plot_results.MEMSCAN)) as f:
    scan = json.load(f)
  series = plot_results.memory_series(scan)
  assert {"ring-zigzag", "paper", "allgather"} <= set(series)
  row = next(r for r in scan["memscan"] if r["impl"] == "ring-zigzag" and r["causal"])
  assert (row["length"], row["fwdbwd_temp"] / 2**20) in series["ring-zigzag"]
  with open(os.path.join(plot_results.RESULTS, plot_results.PACKED)) as f:
    packed = json.load(f)
  bal = plot_results.balance_series(packed)
  assert set(bal) == {"zigzag", "document"}
  assert all(len(v) == len(packed["means"]) for v in bal.values())
  plot_results.main(["--out-dir", str(tmp_path)])
  for name in ("plot_memory.png", "plot_packed_balance.png", "attention_cpu_4k_causal.png",
               "attention_cpu_4k_full.png"):
    assert (tmp_path / name).stat().st_size > 10_000


def test_count_collectives_reads_tuple_shapes_with_index_comments():
  """A variadic all-reduce's tuple shape names its sixth element on with ``/*index=5*/``
  (compiled CPU HLO of a gradient's combined all-reduce): counted, with every element's
  bytes; an all-gather beside it too."""
  from benchmarks import common
  hlo = ("%all-reduce.3 = (f32[4,8]{1,0}, f32[8]{0}, f32[2]{0}, f32[3]{0}, f32[5]{0}, "
         "/*index=5*/bf16[6]{0}) all-reduce(%a, %b, %c, %d, %e, %f), channel_id=1, "
         "replica_groups={{0,1}}, to_apply=%add\n"
         "ROOT %all-gather.1 = f32[16]{0} all-gather(%g), channel_id=2, dimensions={0}\n")
  counts = common.count_collectives(hlo)
  assert counts["all-reduce"] == {"count": 1, "bytes": 4 * (32 + 8 + 2 + 3 + 5) + 2 * 6}
  assert counts["all-gather"] == {"count": 1, "bytes": 64}
