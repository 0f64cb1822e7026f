"""The pipeline axis: GPipe over `pipeline` == the one-device step (loss and every gradient)."""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import model_utils
import ring_jax
from model_utils import tiny_config
from models import llama
from models import pipeline as pipeline_lib
from models import sharding as shd
from training import batch as batch_lib
from training import data as data_lib
from training import errors
from training import mesh as mesh_lib
from training import step as step_lib
from training import validation as val_lib
import train_procs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The train.py runs: --stop_at_step=N of a schedule longer than any run (so no run ends a
# stage: no eval to compile), and no checkpoint but the one each stop writes.
RUN = {"total_steps": 8, "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
       "async_checkpointing": False}


# tiny.py with 4 layers (so 4 stages divide them), small enough to compile in seconds, on
# one device unless a test sets mesh sizes.
SMALL = {
    "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
    "model.num_layers": 4, "data.seq_len": 64, "batch_size": 8, "eval_batch_size": 8,
    "eval_batches": 1, "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
    "optim.warmup_steps": 0, "optim.lr": 1e-3, "optim.eps": 1e-6,
    "mesh.data": 1, "mesh.sequence": 1,
}


def small_config(**overrides):
  return tiny_config(**{**SMALL, **overrides})


def capture_grads() -> optax.GradientTransformation:
  """An optimizer whose update is zero and whose state is the gradient it was given: after
  one train step the optimizer state holds the step's own gradients (one compiled program
  gives the metrics and the gradients)."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def loss_and_grads(config):
  """``(metrics of one train step, its gradients)`` on ``config.mesh``, same data."""
  sizes = val_lib.validate_config(config, int(np.prod([v for v in config.mesh.values()])))
  devices = jax.devices()[:int(np.prod(list(sizes.values())))]
  mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
  model_cfg = val_lib.llama_config(config)
  built = step_lib.build_train_step(model_cfg, mesh, capture_grads(),
                                    microbatches=config.microbatches, seed=config.seed)
  params, opt_state = built.init_state()
  with jax.set_mesh(mesh):
    sharding = batch_lib.sharding(mesh)
    local = data_lib.make_dataset(config, sharding, sizes["sequence"], split="train")[0]
    batch = data_lib.to_global(local, sharding, (config.batch_size, config.data.seq_len))
    _, grads, metrics = built.step(params, opt_state, batch)
  return jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def one_device():
  return loss_and_grads(small_config())


# FSDP, full remat, the blockwise FFN and the chunked loss inside the stages (same math).
COMPOSED = {"model.fsdp": True, "model.remat_policy": "full", "model.ffn_chunk_size": 8,
            "model.loss_chunk_size": 8}


@pytest.mark.parametrize("mesh,model", [
    (dict(pipeline=2), {}),
    (dict(pipeline=2, sequence=2, tensor=2), {}),
    (dict(pipeline=2, data=2, sequence=2), {}),
    (dict(pipeline=4, sequence=2), {}),
    (dict(pipeline=2, data=2, sequence=2), COMPOSED),
], ids=["p2", "p2xs2xt2", "p2xd2xs2", "p4xs2", "p2xd2xs2-fsdp-remat-chunks"])
def test_pipeline_step_equals_one_device_step(mesh, model, one_device):
  """The train step's loss, every gradient it takes (float32, rtol 1e-5) and its metrics on
  a pipeline mesh (against the one-device step without FSDP, remat or chunking)."""
  config = small_config(**{f"mesh.{k}": v for k, v in mesh.items()}, **model)
  metrics, grads = loss_and_grads(config)
  want_metrics, want_grads = one_device
  np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
  assert metrics["target_tokens"] == want_metrics["target_tokens"]
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  # rtol 1e-5 on every entry; atol at 1e-6 of the largest gradient covers entries that are
  # float32 rounding noise of a sum (near-zero gradients), whose relative error is unbounded.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale),
               grads, want_grads)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_pipelined_model_equals_one_device_on_both_axis_types(auto):
  """The model alone (no trainer) on pipeline=2 x sequence=2 x tensor=2, Explicit and Auto
  axes: logits and the gradient of a weighted sum of them equal the one-device model's."""
  cfg = llama.LlamaConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
                          mlp_dim=64, layout="zigzag", pipeline_microbatches=2)
  params = model_utils.random_params(cfg)
  tokens, pos, segs = model_utils.packed_batch(
      cfg.vocab_size, ((5, 7), (9, 3, 4), (16,), (8, 8)), 16)
  perm = ring_jax.layout_positions("zigzag", 2, 16)
  tokens, pos, segs = tokens[:, perm], pos[:, perm], segs[:, perm]
  weights = np.random.default_rng(0).normal(size=(4, 16, cfg.vocab_size)).astype(np.float32)
  weights *= (segs > 0)[..., None]
  graphdef = model_utils.graphdef(cfg)

  def loss(p, t, q, s, w):
    logits = nnx.merge(graphdef, p)(t, q, s)
    return jnp.sum(logits * w), logits

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, want), want_grads = fn(params, tokens, pos, segs, weights)
  mesh = model_utils.make_mesh(auto=auto, pipeline=2, sequence=2, tensor=2)
  with jax.set_mesh(mesh):
    (_, got), grads = fn(shd.shard_params(params, mesh), tokens, pos, segs, weights)
  real = segs > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                             atol=1e-6)
  want_grads = jax.device_get(nnx.to_pure_dict(want_grads))
  # atol: float32 summation-order noise of the O(B L vocab)-term sums with N(0, 1) weights,
  # relative to the largest gradient (the weights do not average the terms down).
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
               jax.device_get(nnx.to_pure_dict(grads)), want_grads)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
# "%name = shape op(": a tuple shape has spaces (its /*index=N*/ comments are cut first).
_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(collective-permute|all-gather|all-reduce|"
                         r"reduce-scatter|all-to-all)\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def _device_groups(line: str, devices: int) -> list[tuple[int, ...]]:
  """The partition ids each group of a collective's HLO line holds (a collective-permute's
  groups: its (source, target) pairs), in any of the three forms XLA prints: explicit
  ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]`` (optionally ``T(perm)``-transposed), and
  ``mesh['a'=2,...] {'a'}`` (optionally with ``device_ids=(...)``)."""
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  if pairs:
    return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if listed:
    return [tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", listed.group(1))]

  def iota(dims, perm):  # XLA's IotaTileAssignment: arange reshaped to dims, transposed
    ids = np.arange(devices).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids

  tiled = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if tiled:
    return [tuple(g) for g in iota(tiled.group(2), tiled.group(3)).reshape(
        [int(d) for d in tiled.group(1).split(",")]).tolist()]
  named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                    r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
  assert named, f"no device groups in {line[:200]}"
  axes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", named.group(1))]
  ids = (iota(named.group(2), named.group(3)) if named.group(2) else np.arange(devices))
  ids = ids.reshape([n for _, n in axes])
  over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in named.group(4)]
  rest = [i for i in range(len(axes)) if i not in over]
  size = int(np.prod([axes[i][1] for i in over]))
  return [tuple(g) for g in ids.transpose(rest + over).reshape(-1, size).tolist()]


def _collectives(hlo: str, mesh) -> list[dict]:
  """Every collective of compiled HLO text, with how often one run of the program runs it.

  One dict per op: ``kind``; ``bytes``, what one device sends (its operand: an all-gather's
  result over its group size); ``runs``, a while body counted ``known_trip_count`` times
  per run of its caller, a conditional's branch once per run of the conditional (an upper
  bound); ``in_branch``, whether it sits in a conditional's branch; ``axes``, the mesh axes
  its groups span (partition ids are positions in ``mesh.devices``); ``pairs``, a
  collective-permute's (source, target) as mesh coordinates; ``scope``, its op_name.
  """
  comps, current = {}, None
  for line in hlo.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = head.group(1)
      comps[current] = []
    elif line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  # HLO text lists callees before their callers and ENTRY last: reversed, callers come first.
  runs, branches = {list(comps)[-1]: 1}, set()
  for caller in reversed(list(comps)):
    for line in comps[caller]:
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      body = re.findall(r"\bbody=%([\w.\-]+)", line)
      called = re.findall(r"\b(?:condition|calls|to_apply)=%([\w.\-]+)", line)
      listed = re.search(r"branch_computations=\{([^}]*)\}", line)
      branch = re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else []
      branch += re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", line)
      for callee in body + called + branch:
        times = int(trips.group(1)) if trips and callee in body else 1
        runs[callee] = runs.get(callee, 0) + runs.get(caller, 0) * times
        if callee in branch or caller in branches:
          branches.add(callee)
  devices = mesh.devices.size
  coords = lambda d: np.unravel_index(d, mesh.devices.shape)
  found = []
  for name, lines in comps.items():
    for line in lines:
      op = _COLLECTIVE.search(re.sub(r"/\*.*?\*/", "", line))
      if not op or not runs.get(name):
        continue
      shape, kind = op.groups()
      groups = _device_groups(line, devices)
      nbytes = sum((1 if t == "pred" else int(re.sub(r"\D", "", t)) // 8)
                   * math.prod(int(d) for d in dims.split(",") if d)
                   for t, dims in _ARRAY.findall(shape))
      if kind == "all-gather":
        nbytes //= len(groups[0])
      axes = {mesh.axis_names[i] for g in groups for i in range(mesh.devices.ndim)
              if len({coords(d)[i] for d in g}) > 1}
      scope = re.search(r'op_name="([^"]*)"', line)
      found.append(dict(
          kind=kind, bytes=nbytes, runs=runs[name], in_branch=name in branches, axes=axes,
          pairs={tuple(tuple(int(c) for c in coords(d)) for d in g) for g in groups}
          if kind == "collective-permute" else None, scope=scope.group(1) if scope else ""))
  return found


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_pipeline_moves_only_the_activations_the_next_stage_reads(auto):
  """What the pipeline moves in the compiled forward+backward of the model on pipeline=4 x
  sequence=2 (S = 4 stages of one layer, M = 2 microbatches of 2 rows x 16 tokens), Explicit
  and Auto axes, counted in the HLO by the mesh axes each collective's devices differ in
  (ring attention's collective-permutes, within a pipeline stage, span sequence only).

  The schedule runs M + S - 1 = 5 iterations; in iteration t stage s works on microbatch
  t - s. Stage s's output goes to stage s + 1 only (stage S - 1's goes nowhere), so each
  iteration's transfer is one collective-permute of one microbatch's activations per device,
  [2 rows, 16 / 2 tokens, dim 32] float32 = 2048 bytes, with the pairs (s, s + 1) at every
  sequence position; the last iteration's outputs are read by no stage, so it makes none:
  M + S - 2 = 4 transfers. The backward is the transpose: the same with the pairs reversed.
  Both permutes sit in the loop of M + S - 1 trips, in the branch of a conditional (the
  iteration that skips it; how often a branch runs the HLO does not say). Positions and
  segment ids do not travel (each stage holds them), so there is no other permute over
  pipeline. Two all-reduces over pipeline move all M microbatches' activations (4096 bytes):
  the last stage's outputs to every stage (the head runs on each), and in the backward the
  sum of the stages' cotangents of the inputs (stage 0's: the embedding runs on each). No
  all-gather belongs to the pipeline: every all-gather is ring attention's own (on jax 0.10
  an Explicit mesh's boundary gathered the inputs and the saved activations over sequence).
  """
  stages, micro = 4, 2
  cfg = llama.LlamaConfig(vocab_size=64, dim=32, num_layers=stages, num_heads=4,
                          num_kv_heads=2, mlp_dim=64, layout="zigzag",
                          pipeline_microbatches=micro)
  tokens, pos, segs = model_utils.packed_batch(
      cfg.vocab_size, ((5, 7), (9, 3, 4), (16,), (8, 8)), 16)
  graphdef = model_utils.graphdef(cfg)
  fn = jax.jit(jax.grad(lambda p, t, q, s: jnp.sum(nnx.merge(graphdef, p)(t, q, s))))
  mesh = model_utils.make_mesh(auto=auto, pipeline=stages, sequence=2)
  with jax.set_mesh(mesh):
    params = shd.shard_params(model_utils.random_params(cfg), mesh)
    hlo = fn.lower(params, tokens, pos, segs).compile().as_text()
  ops = _collectives(hlo, mesh)
  pipe = {kind: [op for op in ops if op["kind"] == kind and "pipeline" in op["axes"]]
          for kind in ("collective-permute", "all-gather", "all-reduce", "reduce-scatter",
                       "all-to-all")}
  # Ring attention's own hops are there, and told apart.
  assert any(op["kind"] == "collective-permute" and op["axes"] == {"sequence"} for op in ops)

  activations = (4 // micro) * (16 // 2) * cfg.dim * 4
  at = lambda p, q: tuple({"pipeline": p, "sequence": q}.get(a, 0) for a in mesh.axis_names)
  chain = {(at(s, q), at(s + 1, q)) for s in range(stages - 1) for q in range(2)}
  reverse = {(b, a) for a, b in chain}
  permutes = pipe["collective-permute"]
  assert [op["pairs"] for op in permutes] in ([chain, reverse], [reverse, chain]), permutes
  for op in permutes:
    assert op["axes"] == {"pipeline"} and op["bytes"] == activations, op
    assert op["runs"] == micro + stages - 1 and op["in_branch"], op
  reduces = pipe["all-reduce"]
  assert len(reduces) == 2, reduces
  for op in reduces:
    assert op["axes"] == {"pipeline"} and op["bytes"] == micro * activations and op["runs"] == 1
  assert not pipe["all-gather"] + pipe["reduce-scatter"] + pipe["all-to-all"]
  gathers = [op for op in ops if op["kind"] == "all-gather"]
  assert all("/attention/ring/" in op["scope"] for op in gathers), gathers


def test_bubble_fraction_and_default_microbatches():
  assert pipeline_lib.bubble_fraction(1, 8) == 0.0
  assert pipeline_lib.bubble_fraction(2, 4) == pytest.approx(1 / 5)
  assert pipeline_lib.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline_lib.default_microbatches(8, 2) == 4  # 2 x stages
  assert pipeline_lib.default_microbatches(8, 2, data=4) == 2  # rows must split over data
  assert pipeline_lib.default_microbatches(6, 2) == 3
  assert pipeline_lib.default_microbatches(1, 4) == 1


@pytest.mark.parametrize("overrides,match", [
    ({"mesh.pipeline": 4, "mesh.sequence": 2, "model.num_layers": 6},
     r"mesh.pipeline=4 stages do not divide model.num_layers=6; choose mesh.pipeline from "
     r"\[1, 2, 3, 6\]"),
    ({"mesh.pipeline": 2, "mesh.sequence": 4, "model.pipeline_microbatches": 3},
     "batch_size=8 on mesh.pipeline=2: pipeline_microbatches=3 must be >= 1 and divide the "
     "batch of 8 rows"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "model.pipeline_microbatches": 4},
     "2 rows per pipeline microbatch do not divide over the mesh 'data' axis \\(4\\)"),
    ({"mesh.pipeline": 2, "mesh.sequence": 4, "eval_batch_size": 6,
      "model.pipeline_microbatches": 4}, "eval_batch_size=6 on mesh.pipeline=2"),
    ({"model.pipeline_microbatches": 0},
     "config.model: pipeline_microbatches must be None or a positive int, got 0"),
])
def test_config_validation_names_the_pipeline_problem(overrides, match):
  config = small_config(**overrides)
  with pytest.raises(errors.ConfigError, match=match):
    val_lib.validate_config(config, num_devices=int(np.prod(list(config.mesh.values()))))


def test_pipeline_alone_runs_with_default_microbatches():
  """--config.mesh.pipeline=2 alone: validates, with 2 x 2 microbatches of the 8 rows."""
  config = small_config(**{"mesh.pipeline": 2})
  sizes = val_lib.validate_config(config, num_devices=2)
  assert sizes == dict(data=1, pipeline=2, sequence_outer=1, sequence=1, tensor=1)
  assert pipeline_lib.resolve_microbatches(None, config.batch_size, 2) == 4


def train_py(workdir, stop_at_step, **overrides):
  """``python train.py --config configs/tiny.py --stop_at_step=N`` with SMALL's fields (and
  RUN's) as ``--config.*`` flags, in a process that sizes its own devices (a mesh of one
  device here); returns (stdout, losses by step from metrics.jsonl)."""
  flat = {**SMALL, **RUN, **overrides}
  cmd = [os.path.join(ROOT, "configs", "tiny.py"), f"--stop_at_step={stop_at_step}",
         *(f"--config.{k}={v}" for k, v in flat.items())]
  workdir.parent.mkdir(parents=True, exist_ok=True)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", *cmd,
                         "--workdir", str(workdir)], cwd=workdir.parent, env=train_procs.env(),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout, _losses(workdir)


def _losses(workdir) -> dict[int, float]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def train_run(workdir, stop_at_step, capsys, **overrides):
  """``train.train`` (what ``python train.py`` runs) in this process, on its 8 devices, with
  SMALL's fields and RUN's; returns (what it printed, losses by step from metrics.jsonl)."""
  import train as train_script

  capsys.readouterr()
  train_script.train(small_config(**{**RUN, **overrides}), str(workdir),
                     stop_at_step=stop_at_step)
  return capsys.readouterr().out, _losses(workdir)


# The three pipeline meshes of 8 devices, in the order the runs use them (each resuming the
# previous one's checkpoint): sizes as train.py prints them, and its pipeline line.
TRAIN_PY_MESHES = [
    (dict(data=1, pipeline=2, sequence_outer=1, sequence=2, tensor=2),
     "pipeline: 2 stages x 2 layers, GPipe over 4 microbatches, bubble fraction 0.200"),
    (dict(data=2, pipeline=2, sequence_outer=1, sequence=2, tensor=1),
     "pipeline: 2 stages x 2 layers, GPipe over 4 microbatches, bubble fraction 0.200"),
    (dict(data=1, pipeline=4, sequence_outer=1, sequence=2, tensor=1),
     "pipeline: 4 stages x 1 layers, GPipe over 8 microbatches, bubble fraction 0.273"),
]


# Four resumed training runs: a trainer scenario (leg 1); the pipelined step itself is compared
# above.
@pytest.mark.leg1_only
def test_train_py_on_each_pipeline_mesh_follows_one_device(tmp_path, capsys):
  """The trainer for 2 steps on each pipeline mesh of the issue -- pipeline=2 x
  sequence=2 x tensor=2, pipeline=2 x data=2 x sequence=2, pipeline=4 x sequence=2 -- each
  run resuming the one before (so checkpoints restore across pipeline and tensor sizes):
  steps 1-6 have the losses of 6 steps of `python train.py` on one device, float32 rtol
  1e-5. The pipelined runs are train.train in this process (8 devices, no process start
  each); the reference is its own process, which sizes one device."""
  out, want = train_py(tmp_path / "one" / "run", stop_at_step=6)
  assert ("mesh {'data': 1, 'pipeline': 1, 'sequence_outer': 1, 'sequence': 1, "
          "'tensor': 1}") in out
  assert sorted(want) == list(range(1, 7)) and want[6] != want[1]
  workdir, got = tmp_path / "run", {}
  for i, (sizes, pipeline_line) in enumerate(TRAIN_PY_MESHES):
    out, losses = train_run(workdir, 2 * i + 2, capsys,
                            **{f"mesh.{k}": v for k, v in sizes.items()})
    assert f"mesh {sizes}" in out and pipeline_line in out
    assert i == 0 or f"resumed from step {2 * i} " in out, out
    got.update(losses)
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=1e-5)
  # The steps above were compiled for these shardings and the restored arrays were passed
  # to them, so the [layers, ...] arrays restored into stage blocks (1 layer per device).
  config = small_config(**{f"mesh.{k}": v for k, v in TRAIN_PY_MESHES[-1][0].items()})
  mesh = mesh_lib.make_mesh(config.mesh)
  built = step_lib.build_train_step(val_lib.llama_config(config), mesh,
                                    step_lib.make_optimizer(config.optim, 8))
  for leaf in jax.tree.leaves(built.abstract_params.layers):
    assert leaf.sharding.spec[0] == "pipeline" and leaf.sharding.mesh.shape["pipeline"] == 4


def test_llama_7b_on_all_four_axes_validates():
  from configs import llama_7b

  config = llama_7b.get_config("4d")
  assert val_lib.validate_config(config, 256) == dict(data=2, pipeline=4, sequence_outer=1,
                                                      sequence=8, tensor=4)
  assert config.model.num_layers // 4 == 8 and config.model.pipeline_microbatches == 8
