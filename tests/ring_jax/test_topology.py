"""ring_jax.topology: TPU slice names, the libtpu check, the platform compiled for, and (the
``tpu_compiler`` tests, tests/conftest.py) the ring compiled for a TPU slice with no TPU."""

import importlib.metadata
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ring_jax
from ring_jax import analysis
from ring_jax import hardware
from ring_jax import topology
from ring_jax.kernels import selfcheck
from message_utils import assert_states


@pytest.mark.parametrize("name, generation, dims, chips", [
    ("v5e:2x2", "v5e", (2, 2), 4), ("v6e:16x16", "v6e", (16, 16), 256),
    ("v5p:4x4x4", "v5p", (4, 4, 4), 64), ("V5P:2x2x1", "v5p", (2, 2, 1), 4),
    ("v5e:1x1", "v5e", (1, 1), 1)])
def test_names_parse(name, generation, dims, chips):
  assert topology.parse(name) == (generation, dims)
  assert topology.chips(name) == chips
  assert topology.chips(name, slices=3) == 3 * chips


@pytest.mark.parametrize("name", ["v7:2x2", "v5p:2x2", "v5e:2x2x2", "v5e:3x3", "tpu",
                                  "v5e:0x2", "v5p-64"])
def test_unknown_names_list_the_forms_that_work(name):
  with pytest.raises(topology.TopologyError) as e:
    topology.parse(name)
  message = str(e.value)
  assert "\n" not in message and repr(name) in message
  assert message.endswith(f"the forms that work: {topology.FORMS}.")


@pytest.mark.parametrize("version, specifier, ok", [
    ("0.0.42.1", "==0.0.42.*", True), ("0.0.42", "==0.0.42.*", True),
    ("0.0.420", "==0.0.42.*", False), ("0.0.43.0", "==0.0.42.*", False),
    ("0.0.50.1", "==0.0.50.1", True), ("0.0.50.2", "==0.0.50.1", False)])
def test_libtpu_version_matches_the_pin(version, specifier, ok):
  assert topology._matches(version, specifier) is ok


def test_the_pin_is_jax_own():
  """jax's [tpu] extra pins libtpu; this is the pair verified for jax 0.10.2."""
  pin = topology._pinned_libtpu()
  assert pin is not None and pin.startswith("==")
  if jax.__version__ == "0.10.2":
    assert pin == "==0.0.42.*"


def _fake_libtpu(monkeypatch, version):
  real = importlib.metadata.version

  def fake(name):
    if name != "libtpu":
      return real(name)
    if version is None:
      raise importlib.metadata.PackageNotFoundError(name)
    return version

  monkeypatch.setattr(topology.importlib.metadata, "version", fake)


def test_missing_libtpu_names_the_extra(monkeypatch):
  _fake_libtpu(monkeypatch, None)
  for call in (topology.check_libtpu, lambda: topology.devices("v5e:2x2")):
    with pytest.raises(topology.TopologyError) as e:
      call()
    # What is missing, the command that installs it, and which libtpu that installs.
    assert_states(str(e.value), "libtpu", "not installed", 'pip install "ring_jax[tpu]"',
                  f"jax {jax.__version__}")


def test_mismatched_libtpu_names_the_extra(monkeypatch):
  _fake_libtpu(monkeypatch, "0.0.1")
  monkeypatch.setattr(topology, "_pinned_libtpu", lambda: "==0.0.42.*")
  with pytest.raises(topology.TopologyError) as e:
    topology.check_libtpu()
  # The installed libtpu, the jax and the libtpu it pins, and both commands that fix it.
  assert_states(str(e.value), "libtpu 0.0.1", f"jax {jax.__version__}", "libtpu==0.0.42.*",
                'pip install "ring_jax[tpu]"', f'pip install "jax[tpu]=={jax.__version__}"')


def test_target_platform_follows_the_mesh():
  assert topology.target_platform() == jax.default_backend()
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  seen = []

  def f(x):
    seen.append(topology.target_platform())
    return x

  with jax.set_mesh(mesh):
    seen.append(topology.target_platform())
    jax.jit(f)(jnp.zeros(2))
  assert seen == ["cpu", "cpu"]


def test_libtpu_startup_lines_are_dropped_others_kept(capfd):
  with topology.quiet_libtpu():
    os.write(2, b"WARNING: could not determine TPU accelerator type, please set env var "
                b"`TPU_ACCELERATOR_TYPE` manually\n=== Source Location Trace: ===\n"
                b"something else went wrong\n")
  err = capfd.readouterr().err
  assert err.splitlines() == ["something else went wrong"]


def test_per_device_bytes_is_arguments_outputs_temporaries_minus_aliases():
  memory = dict(argument_size_in_bytes=100, output_size_in_bytes=30, temp_size_in_bytes=7,
                alias_size_in_bytes=20)
  assert topology.per_device_bytes(memory) == 117
  assert topology.per_device_bytes({}) is None


# ---- with the TPU compiler ------------------------------------------------------------


@pytest.mark.tpu_compiler
def test_slice_devices_and_hbm():
  devices = topology.devices("v5e:2x2")
  assert len(devices) == 4 and {d.platform for d in devices} == {"tpu"}
  assert devices[0].device_kind == "TPU v5 lite"
  assert topology.hbm_bytes(devices[0]) == hardware.lookup("TPU v5e").memory_bytes
  two = topology.devices("v5e:2x2", slices=2)
  assert sorted(d.slice_index for d in two) == [0] * 4 + [1] * 4
  v5p = topology.devices("v5p:2x2x1")
  assert topology.hbm_bytes(v5p[0]) == hardware.lookup("TPU v5p").memory_bytes


def _ring_on_v5p(hop_kernel):
  """``jit(value_and_grad)`` of a causal zigzag ring of 4 on v5p:2x2x1 and its bf16 args."""
  mesh = jax.make_mesh((4,), ("sequence",), devices=topology.devices("v5p:2x2x1"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, "sequence")))

  def loss(q, k, v):
    out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=True, layout="zigzag",
                                          inputs_in_layout=True, hop_kernel=hop_kernel)
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  return mesh, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (spec, spec, spec)


_MOSAIC = analysis.MOSAIC_CALL


@pytest.mark.tpu_compiler
def test_ring_compiles_for_v5p_with_the_splash_hop():
  """The splash hop compiles to Mosaic kernels for a TPU slice (not Pallas' interpret mode,
  which resolving for this CPU process would pick)."""
  mesh, step, args = _ring_on_v5p("splash")
  with jax.set_mesh(mesh):
    compiled = step.lower(*args).compile()
  # A ring of 4 runs unrolled on TPU (PLATFORM_DEFAULTS["tpu"]["unroll_hops"]): each of the
  # 4 hops calls its forward, dq and dkv kernels. Only the own shard's hop has partly masked
  # block pairs (causal zigzag), so only its 3 kernels take the element mask; the other 3
  # hops differ only in their operands (mask metadata from traced positions) and share 3
  # bodies without it: 12 calls, 6 bodies.
  text = compiled.as_text()
  assert text.count(_MOSAIC) == 4 * 3
  assert sorted(analysis.mosaic_kernels(text).values()) == [1, 1, 1, 3, 3, 3]
  memory = topology.compiled_memory(compiled)
  assert memory["temp_size_in_bytes"] > 0 and memory["argument_size_in_bytes"] == 3 * (
      2048 // 4) * 2 * 128 * 2



@pytest.mark.tpu_compiler
def test_two_level_ring_keeps_every_transfer_in_flight_with_the_splash_hop():
  """The two-level ring (outer 2 x inner 2 on v5p:2x2x1, causal contiguous, the full
  rotation) with the splash hop: every ring transfer has block compute in flight in the TPU
  compiler's schedule, the last step's outer dK/dV transfer included (in flight during that
  step's inner ring, not issued after its last kernel)."""
  devices = np.asarray(topology.devices("v5p:2x2x1")).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("outer", "inner"))
  spec = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, ("outer", "inner"))))

  def loss(q, k, v):
    out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis=("outer", "inner"),
                                          is_causal=True, layout="contiguous",
                                          hop_kernel="splash")
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        spec, spec, spec).compile()
  report = analysis.overlap_report(compiled)
  assert report.kinds()["ring dK/dV (outer)"] == (2, 2)
  assert report.ring() == (18, 18), [t.scope for t in report.exposed()]

@pytest.mark.tpu_compiler
def test_auto_is_splash_on_a_tpu_slice_with_its_self_check_skipped():
  """``auto`` traces the same program as ``splash`` for a TPU slice (lowered only: the
  compile is the test above's), its self-check skipped and said so; ``xla`` has no Mosaic."""
  selfcheck.reset()
  try:
    lowered = {}
    for kernel in ("auto", "splash", "xla"):
      mesh, step, args = _ring_on_v5p(kernel)
      with jax.set_mesh(mesh):
        lowered[kernel] = step.lower(*args).as_text()
    assert lowered["auto"] == lowered["splash"]
    assert "tpu_custom_call" in lowered["splash"] and "tpu_custom_call" not in lowered["xla"]
    assert ring_jax.kernels.describe("auto", platform="tpu") == (
        "hop kernel: splash (auto on tpu: splash bfloat16: self-check skipped: no device "
        "attached, compile only)")
    assert [v.skipped for v in selfcheck.verdicts()] == [True]
  finally:
    selfcheck.reset()


@pytest.mark.tpu_compiler
def test_target_platform_is_the_topology_inside_jit_and_shard_map():
  mesh = jax.make_mesh((4,), ("sequence",), devices=topology.devices("v5e:2x2"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  seen = []

  def inner(x):
    seen.append(topology.target_platform())
    return x

  def f(x):
    seen.append(topology.target_platform())
    return jax.shard_map(inner, mesh=mesh, in_specs=P("sequence"), out_specs=P("sequence"))(x)

  with jax.set_mesh(mesh):
    jax.jit(f).lower(jax.ShapeDtypeStruct((8,), np.float32,
                                          sharding=NamedSharding(mesh, P("sequence"))))
    # The default block is the TPU's, not the CPU's this process runs on.
    assert ring_jax.ring.block_target() == ring_jax.ring.block_target("tpu") == 512
  assert seen == ["tpu", "tpu"]
