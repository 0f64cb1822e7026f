"""ring_jax.analysis: transfers in flight during compute, read from scheduled HLO text.

The hand-written modules below are scheduled HLO as compilers print it (tuple shapes with
layouts and ``/*index=*/`` comments, metadata, backend configs); names are chosen so that a
reader matching substrings (``dot`` in ``%not_a_dot_fusion``, ``send_kv`` in an op_name
that only starts with it) gets them wrong.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

import ring_jax
from ring_jax import analysis
from attn_utils import make_mesh

_SEND_KV = 'op_name="jit(f)/shard_map/ring_fwd/while/body/closed_call/send_kv/ppermute"'
_SEND_DKV = 'op_name="jit(f)/transpose(jvp(f))/shard_map/ring_bwd/send_dkv/ppermute"'

_HEADER = """HloModule jit_f, is_scheduled=true, \
entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

%dot_computation (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%elementwise_dot_named (p0.1: f32[8,8], p1.1: f32[8,8]) -> f32[8,8] {
  %p0.1 = f32[8,8]{1,0} parameter(0)
  %p1.1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.2 = f32[8,8]{1,0} multiply(%p0.1, %p1.1), metadata={op_name="jit(f)/dot_general"}
}

%conv_inner (c0: f32[1,8,8], c1: f32[1,1,8]) -> f32[1,8,8] {
  %c0 = f32[1,8,8]{2,1,0} parameter(0)
  %c1 = f32[1,1,8]{2,1,0} parameter(1)
  ROOT %convolution.3 = f32[1,8,8]{2,1,0} convolution(%c0, %c1), window={size=1}, \
dim_labels=b0f_io0->b0f
}

%conv_outer (o0: f32[1,8,8], o1: f32[1,1,8]) -> f32[1,8,8] {
  %o0 = f32[1,8,8]{2,1,0} parameter(0)
  %o1 = f32[1,1,8]{2,1,0} parameter(1)
  %neg = f32[1,8,8]{2,1,0} negate(%o0)
  ROOT %inner_fusion = f32[1,8,8]{2,1,0} fusion(%neg, %o1), kind=kOutput, calls=%conv_inner
}
"""


def _module(entry_body: str, extra: str = "") -> str:
  return (_HEADER + extra + "\nENTRY %main (a: f32[8,8]) -> f32[8,8] {\n"
          "  %a = f32[8,8]{1,0} parameter(0)\n" + entry_body + "}\n")


def _one(report, name):
  (t,) = [t for t in report.transfers if t.name == name]
  return t


def test_dot_fusion_between_start_and_done_is_in_flight():
  text = _module(f"""\
  %cp-start = (f32[8,8]{{1,0}}, f32[8,8]{{1,0}}, u32[]{{:S(2)}}, \
u32[]{{:S(2)}}) collective-permute-start(%a), channel_id=1, \
source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{{_SEND_KV}}}, \
backend_config={{"flag_configs":[]}}
  %fusion.7 = f32[8,8]{{1,0}} fusion(%a, %a), kind=kOutput, calls=%dot_computation
  %cp-done = f32[8,8]{{1,0}} collective-permute-done(%cp-start), metadata={{{_SEND_KV}}}
  ROOT %out = f32[8,8]{{1,0}} add(%cp-done, %fusion.7)
""")
  report = analysis.overlap_report(text)
  t = _one(report, "cp-start")
  assert (t.kind, t.collective, t.in_flight, t.compute) == (
      "ring K/V", "collective-permute", True, ("fusion.7",))
  assert t.scope == "shard_map/ring_fwd/while/body/closed_call/send_kv/ppermute"
  assert report.kinds() == {"ring K/V": (1, 1)}
  assert report.ring() == (1, 1)
  assert report.summary_lines() == ["ring K/V: 1 of 1 in flight during block compute"]


def test_names_that_mention_compute_are_not_compute():
  # Operand and instruction names contain "dot", "fusion", "convolution"; the fusion's
  # computation multiplies (its root is *named* dot.2); the compute fusion runs after done.
  text = _module(f"""\
  %dot_input = f32[8,8]{{1,0}} negate(%a), metadata={{op_name="jit(f)/dot_general/convolution"}}
  %cp-start = (f32[8,8]{{1,0}}, f32[8,8]{{1,0}}) collective-permute-start(%dot_input), \
source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{{_SEND_DKV}}}
  %not_a_dot_fusion = f32[8,8]{{1,0}} fusion(%dot_input, %a), kind=kLoop, \
calls=%elementwise_dot_named, metadata={{op_name="jit(f)/fusion/dot"}}
  %convolution_copy = f32[8,8]{{1,0}} copy(%not_a_dot_fusion)
  %cp-done = f32[8,8]{{1,0}} collective-permute-done(%cp-start), metadata={{{_SEND_DKV}}}
  %fusion.8 = f32[8,8]{{1,0}} fusion(%cp-done, %convolution_copy), kind=kOutput, \
calls=%dot_computation
  ROOT %out = f32[8,8]{{1,0}} add(%fusion.8, %fusion.8)
""")
  report = analysis.overlap_report(text)
  t = _one(report, "cp-start")
  assert (t.kind, t.in_flight) == ("ring dK/dV", False)
  assert report.exposed() == (t,)
  assert report.summary_lines() == [
      "ring dK/dV: 0 of 1 in flight during block compute",
      "exposed ring dK/dV: transpose(jvp(f))/shard_map/ring_bwd/send_dkv/ppermute"]


def test_nested_fusion_with_convolution_is_compute():
  extra = """
%fused_outer_caller (f0: f32[1,8,8], f1: f32[1,1,8]) -> f32[1,8,8] {
  %f0 = f32[1,8,8]{2,1,0} parameter(0)
  %f1 = f32[1,1,8]{2,1,0} parameter(1)
  ROOT %call_inner = f32[1,8,8]{2,1,0} fusion(%f0, %f1), kind=kLoop, calls=%conv_outer
}
"""
  text = _module("""\
  %r = f32[1,8,8]{2,1,0} reshape(%a)
  %w = f32[1,1,8]{2,1,0} slice(%r), slice={[0:1], [0:1], [0:8]}
  %ag-start = (f32[1,8,8]{2,1,0}, f32[2,8,8]{2,1,0}) all-gather-start(%r), dimensions={0}, \
replica_groups={{0,1}}, metadata={op_name="jit(f)/all_gather"}
  %fusion.9 = f32[1,8,8]{2,1,0} fusion(%r, %w), kind=kLoop, calls=%fused_outer_caller
  %ag-done = f32[2,8,8]{2,1,0} all-gather-done(%ag-start)
  %s = f32[1,8,8]{2,1,0} slice(%ag-done), slice={[1:2], [0:8], [0:8]}
  %sum = f32[1,8,8]{2,1,0} add(%s, %fusion.9)
  ROOT %out = f32[8,8]{1,0} reshape(%sum)
""", extra)
  report = analysis.overlap_report(text)
  t = _one(report, "ag-start")
  assert (t.kind, t.collective, t.compute) == ("all-gather", "all-gather", ("fusion.9",))
  assert report.summary_lines() == ["all-gather: 1 of 1 in flight during compute"]


def test_loop_body_pairs_and_compute_in_called_loops_and_branches():
  # A while body holds two pairs: one spans an inner while whose body has a dot (in flight),
  # one spans only a conditional whose branches move data (exposed). Each counts once.
  extra = f"""
%inner_body (ib: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %ib = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i0 = s32[] get-tuple-element(%ib), index=0
  %x0 = f32[8,8]{{1,0}} get-tuple-element(%ib), index=1
  %mm = f32[8,8]{{1,0}} dot(%x0, %x0), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %it = (s32[], f32[8,8]{{1,0}}) tuple(%i0, %mm)
}}

%inner_cond (ic: (s32[], f32[8,8])) -> pred[] {{
  %ic = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i1 = s32[] get-tuple-element(%ic), index=0
  %c5 = s32[] constant(5)
  ROOT %lt = pred[] compare(%i1, %c5), direction=LT
}}

%branch_a (ba: f32[8,8]) -> f32[8,8] {{
  %ba = f32[8,8]{{1,0}} parameter(0)
  ROOT %cp-inner = f32[8,8]{{1,0}} collective-permute(%ba), \
source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{op_name="jit(f)/switch/ppermute"}}
}}

%branch_b (bb: f32[8,8]) -> f32[8,8] {{
  %bb = f32[8,8]{{1,0}} parameter(0)
  ROOT %negb = f32[8,8]{{1,0}} negate(%bb)
}}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %p = (s32[], f32[8,8]{{1,0}}, /*index=2*/f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{{1,0}} get-tuple-element(%p), index=1
  %send-kv-start = (f32[8,8]{{1,0}}, f32[8,8]{{1,0}}) collective-permute-start(%x), \
source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{{_SEND_KV}}}
  %init = (s32[], f32[8,8]{{1,0}}) tuple(%i, %x)
  %loop = (s32[], f32[8,8]{{1,0}}) while(%init), condition=%inner_cond, body=%inner_body
  %send-kv-done = f32[8,8]{{1,0}} collective-permute-done(%send-kv-start)
  %y = f32[8,8]{{1,0}} get-tuple-element(%loop), index=1
  %dkv-start = (f32[8,8]{{1,0}}, f32[8,8]{{1,0}}) collective-permute-start(%y), \
source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{{_SEND_DKV}}}
  %k = s32[] constant(0)
  %cond.1 = f32[8,8]{{1,0}} conditional(%k, %y, %y), branch_computations={{%branch_a, %branch_b}}
  %dkv-done = f32[8,8]{{1,0}} collective-permute-done(%dkv-start)
  %z = f32[8,8]{{1,0}} add(%dkv-done, %cond.1)
  ROOT %t = (s32[], f32[8,8]{{1,0}}) tuple(%i, %z)
}}

%cond (pc: (s32[], f32[8,8])) -> pred[] {{
  %pc = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %ic2 = s32[] get-tuple-element(%pc), index=0
  %c3 = s32[] constant(3)
  ROOT %lt2 = pred[] compare(%ic2, %c3), direction=LT
}}
"""
  text = _module("""\
  %zero = s32[] constant(0)
  %tup = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%tup), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %res = f32[8,8]{1,0} get-tuple-element(%w), index=1
""", extra)
  report = analysis.overlap_report(text)
  kv, dkv = _one(report, "send-kv-start"), _one(report, "dkv-start")
  assert (kv.computation, kv.compute) == ("body", ("loop",))
  assert (dkv.computation, dkv.in_flight) == ("body", False)
  inner = _one(report, "cp-inner")  # a synchronous collective: exposed
  assert (inner.asynchronous, inner.in_flight, inner.kind) == (False, False,
                                                               "collective-permute")
  assert report.kinds() == {"ring K/V": (1, 1), "ring dK/dV": (0, 1),
                            "collective-permute": (0, 1)}
  assert report.summary_lines()[2] == ("collective-permute: 0 of 1 in flight during compute "
                                       "(1 synchronous)")


def test_async_wrapped_collective_and_custom_calls():
  # reduce-scatter run by async-start/-update/-done; a Mosaic custom call is compute, a
  # sharding annotation is not; a scope that merely starts with "send_kv" is no ring scope.
  extra = """
%rs_computation (r0: f32[8,8]) -> f32[4,8] {
  %r0 = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[4,8]{1,0} reduce-scatter(%r0), dimensions={0}, replica_groups={{0,1}}, \
to_apply=%add
}
"""
  text = _module("""\
  %rs-start = ((f32[8,8]{1,0}), f32[4,8]{1,0}) async-start(%a), calls=%rs_computation, \
metadata={op_name="jit(f)/send_kv_extra/reduce_scatter"}
  %mosaic = f32[8,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", \
backend_config="{\\"custom_call_config\\": {\\"body\\": \\"dot(\\"}}"
  %rs-update = ((f32[8,8]{1,0}), f32[4,8]{1,0}) async-update(%rs-start)
  %rs-done = f32[4,8]{1,0} async-done(%rs-update)
  %ar-start = f32[8,8]{1,0} all-reduce-start(%mosaic), replica_groups={{0,1}}, to_apply=%add
  %annot = f32[8,8]{1,0} custom-call(%mosaic), custom_call_target="Sharding", sharding={replicated}
  %ar-done = f32[8,8]{1,0} all-reduce-done(%ar-start)
  %pad = f32[8,8]{1,0} pad(%rs-done, %c), padding=0_4x0_0
  ROOT %out = f32[8,8]{1,0} add(%ar-done, %annot)
""", extra)
  report = analysis.overlap_report(text)
  rs, ar = _one(report, "rs-start"), _one(report, "ar-start")
  assert (rs.collective, rs.kind, rs.compute) == ("reduce-scatter", "reduce-scatter",
                                                  ("mosaic",))
  assert (ar.collective, ar.in_flight) == ("all-reduce", False)
  assert len(report.transfers) == 2  # the wrapped reduce-scatter is not counted again


def test_parse_instruction_fields():
  inst = analysis.parse_instruction(
      '  ROOT %tuple.9 = (s32[]{:T(128)}, /*index=1*/bf16[1,2048,8,128]{3,1,2,0:T(8,128)(2,1)}) '
      'conditional(%p.1, %t.2, %t.3), branch_computations={%region_1.2_spmd, %region_3.4}, '
      'metadata={op_name="jit(f)/ring_fwd/hop/cond" stack_frame_id=7}')
  assert (inst.name, inst.opcode, inst.operands, inst.called, inst.op_name) == (
      "tuple.9", "conditional", ("p.1", "t.2", "t.3"), ("region_1.2_spmd", "region_3.4"),
      "jit(f)/ring_fwd/hop/cond")
  assert analysis.parse_instruction("  }") is None
  loop = analysis.parse_instruction(
      '  %w = (s32[], f32[8]{0}) while(%t), condition=%c, body=%b, '
      'backend_config={"known_trip_count":{"n":"4"}}')
  permute = analysis.parse_instruction(
      '  %cp = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,0}}')
  assert (loop.trip_count, loop.called, loop.source_target_pairs) == (4, ("c", "b"), ())
  assert (permute.trip_count, permute.source_target_pairs) == (None, ((0, 1), (1, 2), (2, 0)))


def test_executions_counts_loop_trips_and_switch_branches():
  """A while body runs its known trip count per run of its caller, a loop without one once;
  a conditional with as many branches as its loop has trips (a ``lax.switch`` on the step)
  runs each branch once per run of the loop, any other conditional's branches every time."""
  text = """
%sw_a (a0: f32[8]) -> f32[8] {
  ROOT %a0 = f32[8]{0} parameter(0)
}

%sw_b (b0: f32[8]) -> f32[8] {
  ROOT %b0 = f32[8]{0} parameter(0)
}

%other (o0: f32[8]) -> f32[8] {
  ROOT %o0 = f32[8]{0} parameter(0)
}

%inner (i0: f32[8]) -> f32[8] {
  ROOT %i0 = f32[8]{0} parameter(0)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %s = f32[8]{0} conditional(%k, %x, %x), branch_computations={%sw_a, %sw_b}
  %o = f32[8]{0} conditional(%k, %s, %s, %s), branch_computations={%other, %sw_a, %sw_b}
  %w2 = f32[8]{0} while(%o), condition=%cond, body=%inner
  ROOT %t = (s32[], f32[8]{0}) tuple(%k, %w2)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %tup = (s32[], f32[8]{0}) tuple(%zero, %a)
  %w = (s32[], f32[8]{0}) while(%tup), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"2"}}
  ROOT %res = f32[8]{0} get-tuple-element(%w), index=1
}
"""
  runs = analysis.executions(analysis.parse_module(text))
  assert (runs["main"], runs["body"], runs["inner"], runs["other"]) == (1, 2, 2, 2)
  assert runs["sw_a"] == runs["sw_b"] == 1 + 2  # the switch's once, the other conditional's 2


def _ring_loss(mesh, **kw):
  def loss(q, k, v):
    out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=True, hop_kernel="xla",
                                          **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_cpu_compiled_ring_transfers_are_synchronous():
  """XLA:CPU runs collectives synchronously: every ring transfer of a compiled fwd+bwd is
  found, by its name scope, and none can be in flight."""
  mesh = make_mesh((4,), ("sequence",))
  x = jnp.zeros((1, 64, 2, 8), jnp.float32)
  compiled = _ring_loss(mesh, layout="zigzag", inputs_in_layout=True).lower(x, x, x).compile()
  report = analysis.overlap_report(compiled)
  kinds = report.kinds()
  # forward: K and V in the loop body; backward (it starts on the forward's last parts and
  # ends on each owner: routing.backward_rotation): K/V sent at its first hop and in the
  # loop body, dK/dV arriving in the loop body and at the last hop (one pair each)
  assert kinds == {"ring K/V": (0, 6), "ring dK/dV": (0, 4),
                   **{k: v for k, v in kinds.items() if not k.startswith("ring")}}
  assert all(not t.asynchronous for t in report.transfers)


def _tpu_compile_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(not _tpu_compile_available(),
                    reason="needs libtpu (the CI leg whose jax has a matching libtpu "
                    "installs it)")
def test_tpu_compiled_ring_transfers_overlap_block_compute():
  """The real TPU compiler, deviceless (v5p:2x2x1, a ring of 4): every ring K/V and dK/dV
  transfer of a fwd+bwd is in flight during block compute."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import mesh_utils, topologies
  topo = topologies.get_topology_desc(
      platform="tpu", topology_name="v5p:2x2x1", chip_config_name="default",
      chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
  mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((1, 4), devices=topo.devices),
                           ("data", "sequence"))
  spec = jax.sharding.NamedSharding(mesh, jax.P("data", "sequence", None, None))
  x = jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16, sharding=spec)
  report = analysis.overlap_report(_ring_loss(mesh, layout="zigzag").lower(x, x, x).compile())
  kinds = report.kinds()
  assert kinds["ring K/V"][1] > 0 and kinds["ring dK/dV"][1] > 0
  for kind in ("ring K/V", "ring dK/dV"):
    hidden, total = kinds[kind]
    assert hidden == total, report.summary_lines()


def test_cpu_compiled_layout_reorder_is_its_own_kind():
  """Natural-order inputs: the zigzag reorder's transfers (two per group of arrays moved
  together and direction) are counted as ``layout reorder``, not as ring transfers."""
  mesh = make_mesh((4,), ("sequence",))
  x = jnp.zeros((1, 64, 2, 8), jnp.float32)
  report = analysis.overlap_report(_ring_loss(mesh, layout="zigzag").lower(x, x, x).compile())
  kinds = report.kinds()
  # q, k, v in together and the output back (forward); their transposes (backward)
  assert kinds["layout reorder"] == (0, 8)
  assert report.ring() == (0, 10)
  assert "collective-permute" not in kinds


def test_mosaic_kernels_counts_calls_per_distinct_body():
  """Two calls of one kernel body (escaped and plain JSON configs, as lowered and compiled
  text print them) and one of another; other custom calls are not Mosaic kernels."""
  text = _module("""\
  %k1 = f32[8,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", \
backend_config={"flag_configs":[],"custom_call_config":{"body":"QUJD","cost_estimate":{}}}
  %k2 = f32[8,8]{1,0} custom-call(%k1), custom_call_target="tpu_custom_call", \
frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, backend_config="{\\"custom_call_config\\": {\\"body\\": \\"QUJD\\"}}"
  %s = f32[8,8]{1,0} custom-call(%k2), custom_call_target="Sharding", sharding={replicated}, \
backend_config={"custom_call_config":{"body":"QUJD"}}
  ROOT %k3 = f32[8,8]{1,0} custom-call(%s), custom_call_target="tpu_custom_call", \
backend_config={"custom_call_config":{"body":"REVG"}}
""")
  assert sorted(analysis.mosaic_kernels(text).values()) == [1, 2]
  assert text.count(analysis.MOSAIC_CALL) == 3
